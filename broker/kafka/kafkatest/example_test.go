package kafkatest_test

import (
	"context"
	"fmt"
	"log"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/broker/kafka/kafkatest"
)

// A handler's test opens a kafka:// broker on an in-process cluster: what it publishes and
// consumes goes through the real Kafka client and protocol. In a test, kafkatest.New(t) starts
// the cluster and closes it when the test ends.
func Example() {
	c, err := kafkatest.Start(kafkatest.Config{Partitions: 1})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	ctx := context.Background()
	b, err := broker.Open(ctx, c.URL("group=billing"), broker.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()

	if err := b.Publisher().Publish("orders", message.NewMessage("order-1", []byte(`{"amount":42}`))); err != nil {
		log.Fatal(err)
	}
	sub, err := b.Subscriber()
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		log.Fatal(err)
	}
	m := <-msgs
	fmt.Println(m.UUID, string(m.Payload))
	m.Ack()
	// Output: order-1 {"amount":42}
}
