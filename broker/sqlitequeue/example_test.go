package sqlitequeue_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// Publish a message, consume it, and see that the consumer group has nothing left to do.
func Example() {
	dir, err := os.MkdirTemp("", "sqlitequeue-example")
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	ctx := context.Background()

	q, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), sqlitequeue.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = q.Close() }()

	if err := q.Publisher().Publish("orders", message.NewMessage("order-1", []byte(`{"total":42}`))); err != nil {
		log.Fatal(err)
	}

	sub, err := q.Subscriber()
	if err != nil {
		log.Fatal(err)
	}
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		log.Fatal(err)
	}
	msg := <-msgs
	fmt.Printf("received %s %s\n", msg.UUID, msg.Payload)
	msg.Ack()
	if err := sub.Close(); err != nil { // commits the acknowledgement
		log.Fatal(err)
	}

	backlog, err := q.Backlog(ctx, "orders", sqlitequeue.DefaultConsumerGroup)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("backlog:", backlog)
	// Output:
	// received order-1 {"total":42}
	// backlog: 0
}

// A nacked message comes back after its delay, with its delivery count up by one, and the
// message behind it does not wait for it.
func ExampleQueue_Subscriber_nack() {
	dir, err := os.MkdirTemp("", "sqlitequeue-example")
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	ctx := context.Background()

	q, err := sqlitequeue.Open(ctx, filepath.Join(dir, "queue.db"), sqlitequeue.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = q.Close() }()
	err = q.Publisher().Publish("orders", message.NewMessage("order-1", nil), message.NewMessage("order-2", nil))
	if err != nil {
		log.Fatal(err)
	}

	sub, err := q.Subscriber()
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = sub.Close() }()
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		log.Fatal(err)
	}
	for range 3 {
		msg := <-msgs
		info, _ := redelivery.FromContext(msg.Context())
		fmt.Printf("%s, delivery %d\n", msg.UUID, info.Count)
		if msg.UUID == "order-1" && info.Count == 1 {
			redelivery.NackAfter(msg, 100*time.Millisecond)
			continue
		}
		msg.Ack()
	}
	// Output:
	// order-1, delivery 1
	// order-2, delivery 1
	// order-1, delivery 2
}
