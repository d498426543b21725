// Kafka is a program that consumes from Kafka into PostgreSQL. It imports the root package,
// broker with its kafka scheme, and sqldb with the PostgreSQL driver: it must link no other
// broker client and no other database driver.
package main

import (
	"context"
	"log"
	"os"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
)

func main() {
	ctx := context.Background()
	db, err := sqldb.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	b, err := broker.Open(ctx, os.Getenv("BROKER_URL"), broker.Options{ConsumerGroup: "ledger"})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	sub, err := b.Subscriber()
	if err != nil {
		log.Fatal(err)
	}
	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher()})
	if err != nil {
		log.Fatal(err)
	}
	err = router.AddHandler(onceflow.Handler{
		Name:       "ledger",
		Topic:      "payments",
		Subscriber: sub,
		DB:         db,
		QoS:        onceflow.ExactlyOnce,
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, _ := processor.TxFromContext(ctx)
			_, err := tx.ExecContext(ctx, `INSERT INTO ledger (payment_id) VALUES ($1)`, msg.ID)
			return err
		}),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
