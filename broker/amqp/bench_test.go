package amqp_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/redelivery"
)

// BenchmarkSubscriber_ConsumeAndAck publishes 2000 messages per iteration, then consumes and
// acks them with one subscription at the default prefetch (10), each message handled in a
// goroutine of its own after work, as watermill's router does: with this package's Subscriber
// ("onceflow"; "onceflow-direct" subscribes as onceflow's router does, and calls
// redelivery.Settle after each ack) and with watermill-amqp's ("watermill-amqp") over the same
// topology, side by side. msgs/s counts the consumption only. Compare the ratios of one run: the machine is
// shared.
//
//	CI=true go test ./broker/amqp/ -run '^$' -bench BenchmarkSubscriber_ConsumeAndAck
func BenchmarkSubscriber_ConsumeAndAck(b *testing.B) {
	const n = 2000
	onceflow := func(b *testing.B, f *fixture) message.Subscriber {
		s, err := amqp.NewSubscriber(f.config(amqp.DefaultPrefetch))
		require.NoError(b, err)
		return s
	}
	subscribers := []struct {
		name   string
		new    func(b *testing.B, f *fixture) message.Subscriber
		direct bool
	}{
		{"onceflow", onceflow, false},
		{"onceflow-direct", onceflow, true},
		{"watermill-amqp", func(b *testing.B, f *fixture) message.Subscriber {
			s, err := wamqp.NewSubscriber(wamqp.Config{
				Connection:      wamqp.ConnectionConfig{AmqpURI: f.url, Reconnect: wamqp.DefaultReconnectConfig()},
				Marshaler:       amqp.Marshaler{},
				Exchange:        wamqp.ExchangeConfig{GenerateName: func(topic string) string { return topic }, Type: "fanout", Durable: true},
				Queue:           wamqp.QueueConfig{GenerateName: f.topology.QueueName, Durable: true},
				QueueBind:       wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "" }},
				Consume:         wamqp.ConsumeConfig{Qos: wamqp.QosConfig{PrefetchCount: amqp.DefaultPrefetch}},
				TopologyBuilder: f.topology,
			}, watermill.NopLogger{})
			require.NoError(b, err)
			return s
		}, false},
	}
	for _, work := range []time.Duration{0, time.Millisecond} {
		for _, sc := range subscribers {
			b.Run(fmt.Sprintf("work=%s/%s", work, sc.name), func(b *testing.B) {
				f := setup(b, amqp.Queue{})
				for range b.N {
					b.StopTimer()
					publishParallel(b, f, n)
					sub := sc.new(b, f)
					ctx, cancel := context.WithCancel(context.Background())
					if sc.direct {
						ctx = redelivery.WithDirectSettle(ctx)
					}
					msgs, err := sub.Subscribe(ctx, f.topic)
					require.NoError(b, err)
					var handlers sync.WaitGroup
					b.StartTimer()
					for range n {
						m := <-msgs
						handlers.Go(func() {
							if work > 0 {
								time.Sleep(work)
							}
							m.Ack()
							redelivery.Settle(m)
						})
					}
					handlers.Wait()
					b.StopTimer()
					cancel()
					require.NoError(b, sub.Close())
					f.eventuallyReady(0)
				}
				b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "msgs/s")
			})
		}
	}
}

// publishParallel publishes n messages to the fixture's topic from 8 goroutines, one per
// channel of the publisher.
func publishParallel(b *testing.B, f *fixture, n int) {
	var wg sync.WaitGroup
	const publishers = 8
	for p := range publishers {
		wg.Go(func() {
			for i := p; i < n; i += publishers {
				m := message.NewMessage(watermill.NewUUID(), []byte("payload"))
				if err := f.pub.Publish(f.topic, m); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}
