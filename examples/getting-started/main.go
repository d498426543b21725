// Getting-started is the program that docs/getting-started.md builds: a service that books
// orders from a queue into a database exactly once, with an interceptor of its own in the
// library's chain. It runs on the embedded default (SQLite files as the queue and as the
// database), and on RabbitMQ and PostgreSQL, or MariaDB, by URL. -demo publishes four orders
// first: one of them twice, as a broker redelivers after a lost acknowledgement, and one
// without a tenant, which the service refuses.
//
//	go run ./examples/getting-started -demo    # Ctrl-C stops it
//	go run ./examples/getting-started -demo -broker amqp://guest:guest@127.0.0.1:5672/ -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
package main

import (
	"context"
	"errors"
	"flag"
	"log"
	"os"
	"os/signal"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/amqp"        // amqp://
	_ "github.com/onceflow/onceflow/broker/sqlitequeue" // sqlite:// as a broker: the embedded queue
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"    // mysql://
	_ "github.com/onceflow/onceflow/sqldb/postgres" // postgres://
	_ "github.com/onceflow/onceflow/sqldb/sqlite"   // sqlite://
)

// Order is the payload of a message of the topic orders.
type Order struct {
	Item     string `json:"item"`
	Quantity int    `json:"quantity"`
}

func main() {
	brokerURL := flag.String("broker", "sqlite://queue.db", "broker URL")
	dbURL := flag.String("db", "sqlite://app.db", "database URL")
	demo := flag.Bool("demo", false, "publish four orders before consuming")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *brokerURL, *dbURL, "orders", *demo); err != nil {
		log.Fatal(err)
	}
}

// book is the processor: it writes one order's effect through the transaction onceflow opened
// for the message, which commits with the record of the message's id, or not at all.
func book(ctx context.Context, msg *messagedata.MessageData, o Order) error {
	tx, _ := processor.TxFromContext(ctx)
	_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO orders (order_id, tenant, item, quantity) VALUES (?, ?, ?, ?)`),
		msg.ID, msg.Header("tenant"), o.Item, o.Quantity)
	if err == nil {
		log.Printf("booked %s: %d x %s for %s", msg.ID, o.Quantity, o.Item, msg.Header("tenant"))
	}
	return err
}

// requireTenant is an interceptor of this service's own: a message without a tenant header can
// never succeed, so it fails as permanent, and is dead-lettered at once, never retried.
func requireTenant(next processor.Processor) processor.Processor {
	return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		if msg.Header("tenant") == "" {
			return processor.Permanent(errors.New("no tenant header"))
		}
		return next.Process(ctx, msg)
	})
}

func run(ctx context.Context, brokerURL, dbURL, topic string, demo bool) error {
	b, err := broker.Open(ctx, brokerURL, broker.Options{ConsumerGroup: "orders"})
	if err != nil {
		return err
	}
	defer b.Close()
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	_, err = db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (
		order_id VARCHAR(64) NOT NULL, tenant VARCHAR(64) NOT NULL, item VARCHAR(64) NOT NULL, quantity BIGINT NOT NULL)`)
	if err != nil {
		return err
	}
	if demo {
		if err := publishDemo(b.Publisher(), topic); err != nil {
			return err
		}
	}

	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher()})
	if err != nil {
		return err
	}
	sub, err := b.Subscriber()
	if err != nil {
		return err
	}
	chain := onceflow.ExactlyOnce.Chain().Before(onceflow.StageRetry, onceflow.Use("tenant", requireTenant))
	log.Printf("chain: %s", chain)
	err = router.AddHandler(onceflow.Handler{
		Name:       "orders", // part of every message's record: keep it when you deploy
		Topic:      topic,
		Subscriber: sub,
		DB:         db,
		Chain:      chain,
		Processor:  processor.JSON(book),
	})
	if err != nil {
		return err
	}
	return router.Run(ctx) // until ctx ends; each message is acknowledged after its commit
}

// publishDemo publishes four orders: order-2 twice, as a broker delivers a message again after
// a lost acknowledgement, and order-3 without a tenant.
func publishDemo(pub message.Publisher, topic string) error {
	msgs := []*message.Message{
		message.NewMessage("order-1", []byte(`{"item": "apple", "quantity": 3}`)),
		message.NewMessage("order-2", []byte(`{"item": "pear", "quantity": 1}`)),
		message.NewMessage("order-2", []byte(`{"item": "pear", "quantity": 1}`)),
		message.NewMessage("order-3", []byte(`{"item": "plum", "quantity": 2}`)),
	}
	for _, m := range msgs[:3] {
		m.Metadata.Set("tenant", "acme")
	}
	return pub.Publish(topic, msgs...)
}
