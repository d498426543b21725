package mem_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/mem"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// BenchmarkSubscriber_ConsumeAndAck drains a backlog of b.N messages with one subscription
// that acks each message as it arrives, and reports msgs/s and the allocations and µs of CPU
// per message of the process over the drain; "direct" is a consumer that settles each message itself
// (redelivery.Settle after each ack), as onceflow's router does.
//
//	go test -run '^$' -bench BenchmarkSubscriber_ -benchtime 20000x ./broker/mem
func BenchmarkSubscriber_ConsumeAndAck(b *testing.B) {
	for _, direct := range []bool{false, true} {
		b.Run(fmt.Sprintf("direct=%t", direct), func(b *testing.B) {
			h := mem.NewHub()
			defer h.Close()
			sub, err := mem.NewSubscriber(h, mem.Config{ConsumerGroup: "bench", Prefetch: 128})
			require.NoError(b, err)
			msgs := make([]*message.Message, b.N)
			for i := range msgs {
				msgs[i] = message.NewMessage(fmt.Sprintf("m-%d", i), []byte(`{"n":1}`))
			}
			require.NoError(b, h.Publish("bench", msgs...))
			ctx := context.Background()
			if direct {
				ctx = redelivery.WithDirectSettle(ctx)
			}
			b.ResetTimer()
			testsvc.Drain(b, sub, ctx, "bench", b.N)
		})
	}
}
