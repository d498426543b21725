package nats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// benchMessages is how many messages each round of the benchmark publishes, then consumes.
const benchMessages = 2000

// BenchmarkSubscriber_ConsumeAndAck publishes benchMessages messages to a fresh topic, then
// times one subscription of a fresh consumer group consuming and acknowledging all of them:
// with this package's subscriber, and with watermill-nats's push subscriber configured as
// package broker configured it before (one delivery at a time, synchronous acks). Each
// message is handled in a goroutine of its own, as watermill's router does, by a handler that
// takes no time or 1 ms (a database commit); "onceflow-direct" is this package's subscriber
// with a consumer that settles each message itself (redelivery.Settle after each ack), as
// onceflow's router does. It reports msgs/s for each, and the process's allocations and µs of
// CPU per message while consuming: compare the subscribers of one run (the machine is shared;
// the ratio is what holds).
//
//	CI=true go test -run '^$' -bench BenchmarkSubscriber_ ./broker/nats/
func BenchmarkSubscriber_ConsumeAndAck(b *testing.B) {
	rawURL := testsvc.NATSURL(b)
	onceflow := func(b *testing.B, group string) message.Subscriber {
		s, err := natsbroker.NewSubscriber(natsbroker.Config{URL: rawURL, ConsumerGroup: group})
		require.NoError(b, err)
		return s
	}
	subscribers := []struct {
		name   string
		new    func(b *testing.B, group string) message.Subscriber
		direct bool // the consumer settles each message itself, as onceflow's router does
	}{
		{"onceflow", onceflow, false},
		{"onceflow-direct", onceflow, true},
		{"watermill-nats", func(b *testing.B, group string) message.Subscriber {
			return watermillNATSSubscriber(b, rawURL, group)
		}, false},
	}
	for _, work := range []time.Duration{0, time.Millisecond} {
		for _, sc := range subscribers {
			b.Run(fmt.Sprintf("handler=%s/%s", work, sc.name), func(b *testing.B) {
				var elapsed time.Duration
				var cost testsvc.Cost
				for range b.N {
					topic := testsvc.UniqueName("bench")
					group := testsvc.UniqueName("g")
					publishBench(b, rawURL, topic, benchMessages)
					sub := sc.new(b, group)
					start := time.Now()
					cost.Start()
					consumeBench(b, sub, topic, benchMessages, work, sc.direct)
					cost.Stop()
					elapsed += time.Since(start)
					require.NoError(b, sub.Close())
					testsvc.RemoveTopics(b, rawURL, nil, topic)
				}
				b.ReportMetric(0, "ns/op")
				b.ReportMetric(float64(benchMessages*b.N)/elapsed.Seconds(), "msgs/s")
				cost.Report(b, benchMessages*b.N)
			})
		}
	}
}

// publishBench publishes n messages to topic in the wire format of package broker's
// publisher, asynchronously, and waits for JetStream to store them all.
func publishBench(b *testing.B, rawURL, topic string, n int) {
	b.Helper()
	nc, err := nats.Connect(rawURL)
	require.NoError(b, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(b, err)
	_, err = natsbroker.NewStreams(js).Ensure(context.Background(), topic)
	require.NoError(b, err)
	for i := range n {
		m, err := (&wnats.NATSMarshaler{}).Marshal(topic, message.NewMessage(fmt.Sprintf("%s-%d", topic, i), []byte(`{"n":1}`)))
		require.NoError(b, err)
		_, err = js.PublishMsgAsync(m)
		require.NoError(b, err)
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("JetStream did not store the messages within a minute")
	}
}

// consumeBench subscribes sub to topic and acks n distinct messages, each in a goroutine of
// its own after work; direct subscribes with redelivery.WithDirectSettle and settles each
// message right after its ack.
func consumeBench(b *testing.B, sub message.Subscriber, topic string, n int, work time.Duration, direct bool) {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if direct {
		ctx = redelivery.WithDirectSettle(ctx)
	}
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(b, err)
	acked := make(chan string, n)
	seen := map[string]bool{}
	timeout := time.After(5 * time.Minute)
	for len(seen) < n {
		select {
		case m := <-ch:
			go func() {
				if work > 0 {
					time.Sleep(work)
				}
				m.Ack()
				redelivery.Settle(m)
				acked <- m.UUID
			}()
		case id := <-acked:
			seen[id] = true
		case <-timeout:
			b.Fatalf("%d of %d messages acked after 5 minutes", len(seen), n)
		}
	}
}

// watermillNATSSubscriber returns watermill-nats's subscriber as package broker set it up
// before broker/nats: a durable push consumer of the group, created beforehand, with a deliver
// group, manual synchronous acks and one subscription goroutine per Subscribe.
func watermillNATSSubscriber(b *testing.B, rawURL, group string) message.Subscriber {
	b.Helper()
	nc, err := nats.Connect(rawURL)
	require.NoError(b, err)
	js, err := nc.JetStream()
	require.NoError(b, err)
	name := func(_, topic string) string { return natsbroker.ConsumerName(group, topic) }
	sub, err := wnats.NewSubscriberWithNatsConn(nc, wnats.SubscriberSubscriptionConfig{
		Unmarshaler:      &wnats.NATSMarshaler{},
		SubscribersCount: 1,
		AckWaitTimeout:   30 * time.Second,
		CloseTimeout:     10 * time.Second,
		SubjectCalculator: func(_, topic string) *wnats.SubjectDetail {
			return &wnats.SubjectDetail{Primary: topic, QueueGroup: natsbroker.ConsumerName(group, topic)}
		},
		JetStream: wnats.JetStreamConfig{
			SubscribeOptions:  []nats.SubOpt{nats.ManualAck()},
			DurableCalculator: name,
			AckAsync:          false,
		},
		QueueGroupPrefix: group,
	}, nil)
	require.NoError(b, err)
	return &pushSubscriber{Subscriber: sub, nc: nc, js: js, group: group}
}

// pushSubscriber creates the group's push consumer before watermill-nats subscribes, as
// package broker did.
type pushSubscriber struct {
	*wnats.Subscriber
	nc    *nats.Conn
	js    nats.JetStreamContext
	group string
}

// Close closes the subscriber, then its connection.
func (s *pushSubscriber) Close() error {
	err := s.Subscriber.Close()
	s.nc.Close()
	return err
}

func (s *pushSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	stream, err := s.js.StreamNameBySubject(topic)
	if err != nil {
		return nil, err
	}
	name := natsbroker.ConsumerName(s.group, topic)
	if _, err := s.js.AddConsumer(stream, &nats.ConsumerConfig{
		Durable:        name,
		DeliverSubject: nats.NewInbox(),
		DeliverGroup:   name,
		DeliverPolicy:  nats.DeliverAllPolicy,
		AckPolicy:      nats.AckExplicitPolicy,
		AckWait:        30 * time.Second,
		MaxDeliver:     -1,
		FilterSubject:  topic,
	}); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}
