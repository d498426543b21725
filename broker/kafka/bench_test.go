package kafka_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	kafkabroker "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// BenchmarkSubscriber_ConsumeAndAck drains a backlog of b.N records, spread over the
// partitions of one topic, with one subscription that acks each message as it arrives, and
// reports msgs/s from the Subscribe to the end of Close, when every ack is committed, and the
// process's allocations and µs of CPU per message over that time. The in-process cluster runs
// in the test process: its share is in the figures, so compare them between commits of this
// package, not with the other brokers'. "direct" is a consumer that settles each message
// itself (redelivery.Settle after each ack), as onceflow's router does.
//
//	go test -run '^$' -bench BenchmarkSubscriber_ -benchtime 20000x ./broker/kafka
func BenchmarkSubscriber_ConsumeAndAck(b *testing.B) {
	brokers := kafkatest.Brokers(b)
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	require.NoError(b, err)
	defer cl.Close()
	admin := kadm.NewClient(cl)
	pub, err := kafkabroker.NewPublisher(kafkabroker.PublisherConfig{Brokers: brokers})
	require.NoError(b, err)
	defer pub.Close()
	for _, direct := range []bool{false, true} {
		b.Run(fmt.Sprintf("direct=%t", direct), func(b *testing.B) {
			topic, group := testsvc.UniqueName("bench"), testsvc.UniqueName("g")
			msgs := make([]*message.Message, b.N)
			for i := range msgs {
				msgs[i] = message.NewMessage(fmt.Sprintf("m-%d", i), []byte(`{"n":1}`))
			}
			for from := 0; from < b.N; from += 1000 {
				require.NoError(b, pub.Publish(topic, msgs[from:min(from+1000, b.N)]...))
			}
			sub, err := kafkabroker.NewSubscriber(kafkabroker.Config{Brokers: brokers, ConsumerGroup: group})
			require.NoError(b, err)
			ctx := context.Background()
			if direct {
				ctx = redelivery.WithDirectSettle(ctx)
			}
			b.ResetTimer()
			testsvc.Drain(b, sub, ctx, topic, b.N)

			offsets, err := admin.FetchOffsets(context.Background(), group)
			require.NoError(b, err)
			var committed int64
			for _, o := range offsets[topic] {
				committed += o.At
			}
			require.Equal(b, int64(b.N), committed, "records committed")
		})
	}
}
