package broker_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
)

// A Broker from a URL: publish a message and consume it. mem:// is the in-process broker for
// tests; the same code runs against amqp://, postgres://, nats://, ... by changing the URL.
func Example() {
	ctx := context.Background()
	b, err := broker.Open(ctx, "mem://example?group=billing", broker.Options{})
	if err != nil {
		panic(err)
	}
	defer b.Close()

	sub, err := b.Subscriber()
	if err != nil {
		panic(err)
	}
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		panic(err)
	}

	order := message.NewMessage("order-1", []byte(`{"total": 42}`))
	order.Metadata.Set("onceflow_key", "customer-7")
	if err := b.Publisher().Publish("orders", order); err != nil {
		panic(err)
	}

	m := <-msgs
	fmt.Println(b.Scheme(), b.ConsumerGroup(), m.UUID, m.Metadata.Get("onceflow_key"), string(m.Payload))
	m.Ack()
	// Output: mem billing order-1 customer-7 {"total": 42}
}
