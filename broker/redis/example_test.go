package redis_test

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
)

// A subscriber of the stream "orders" in the consumer group "billing": up to 100 deliveries
// in flight, each acked when processed, or nacked to come back no sooner than a delay that
// grows with the entry's delivery count.
func ExampleNewSubscriber() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", MaxRetries: -1})
	defer client.Close()
	sub, err := redissub.NewSubscriber(client, redissub.Config{ConsumerGroup: "billing", AckTimeout: time.Minute})
	if err != nil {
		panic(err)
	}
	defer sub.Close()

	msgs, err := sub.Subscribe(context.Background(), "orders")
	if err != nil {
		panic(err)
	}
	for msg := range msgs {
		go func() {
			info, _ := redelivery.FromContext(msg.Context())
			if err := process(msg.Context(), msg.Payload); err != nil {
				redelivery.NackAfter(msg, time.Duration(info.Count)*time.Second)
				return
			}
			msg.Ack()
		}()
	}
}

func process(ctx context.Context, payload []byte) error {
	fmt.Printf("%s\n", payload)
	return ctx.Err()
}
