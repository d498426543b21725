package nats_test

import (
	"context"
	"fmt"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/broker/redelivery"
)

// A subscription hands out up to Prefetch messages before any is acknowledged; each one is
// handled in a goroutine of its own and settled by itself. Package broker makes these
// Subscribers for nats:// URLs; onceflow's router reads the delivery count and delays nacks.
func ExampleNewSubscriber() {
	sub, err := natsbroker.NewSubscriber(natsbroker.Config{
		URL:           "nats://127.0.0.1:4222",
		ConsumerGroup: "billing",
		Prefetch:      64,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(context.Background(), "orders.created")
	if err != nil {
		fmt.Println(err)
		return
	}
	for msg := range msgs {
		go func() {
			info, _ := redelivery.FromContext(msg.Context())
			if info.Count > 5 {
				msg.Ack() // give up on it (onceflow's router dead-letters it first)
				return
			}
			if err := handle(msg.Context(), msg.Payload); err != nil {
				redelivery.NackAfter(msg, 0) // again at once; NackDelay applies to a plain Nack
				return
			}
			msg.Ack()
		}()
	}
}

func handle(context.Context, []byte) error { return nil }
