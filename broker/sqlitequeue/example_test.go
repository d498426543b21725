package sqlitequeue_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ThreeDotsLabs/watermill/message"

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
	if err := sub.Close(); err != nil { // ends the batch: the acknowledgement is committed
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

// A handler publishes to the queue it consumes with the delivered message's context: the
// published message commits together with the acknowledgement.
func ExampleQueue_Subscriber_publishFromHandler() {
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
	pub := q.Publisher()
	if err := pub.Publish("orders", message.NewMessage("order-1", nil)); err != nil {
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
	in := <-msgs
	out := message.NewMessage("shipment-of-"+in.UUID, nil)
	out.SetContext(in.Context()) // written in the delivery's transaction
	if err := pub.Publish("shipments", out); err != nil {
		log.Fatal(err)
	}
	in.Ack()
	if err := sub.Close(); err != nil {
		log.Fatal(err)
	}

	records, err := q.List(ctx, "shipments", 0, 10)
	if err != nil {
		log.Fatal(err)
	}
	for _, r := range records {
		fmt.Println(r.Offset, r.Message.UUID)
	}
	// Output:
	// 1 shipment-of-order-1
}
