package sqlqueue_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/sqldb"
)

// Publish a message to a queue in PostgreSQL, consume it, and ask for it again in a minute
// when it fails. It needs a database, so it is compiled, not run.
func Example() {
	ctx := context.Background()
	db, err := sqldb.Open(ctx, "postgres://postgres@127.0.0.1:5432/app?sslmode=disable")
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	q, err := sqlqueue.New(db.DB.DB, db.Dialect, sqlqueue.Config{ConsumerGroup: "billing", Prefetch: 32})
	if err != nil {
		log.Fatal(err)
	}

	pub, err := q.NewPublisher()
	if err != nil {
		log.Fatal(err)
	}
	if err := q.EnsureTopic(ctx, "orders"); err != nil {
		log.Fatal(err)
	}
	if err := pub.Publish("orders", message.NewMessage("order-1", []byte(`{"total":42}`))); err != nil {
		log.Fatal(err)
	}

	sub := q.Subscriber()
	defer func() { _ = sub.Close() }() // writes the acks given, gives back the rest
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		log.Fatal(err)
	}
	msg := <-msgs // up to 32 are handed out before any is acked
	info, _ := redelivery.FromContext(msg.Context())
	fmt.Printf("received %s, delivery %d\n", msg.UUID, info.Count)
	if err := process(msg); err != nil {
		redelivery.NackAfter(msg, time.Minute) // the lease is visible again in a minute
		return
	}
	msg.Ack() // deletes the lease
}

func process(*message.Message) error { return nil }
