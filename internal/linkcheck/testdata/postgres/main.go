// Postgres is a program that uses onceflow with PostgreSQL alone, its messages coming from any
// watermill subscriber (here watermill's in-process gochannel). It imports the root package,
// processor, sqldb and the PostgreSQL driver: it must link no other database driver and no
// broker client.
package main

import (
	"context"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/onceflow/onceflow"
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
	router, err := onceflow.NewRouter(onceflow.Config{})
	if err != nil {
		log.Fatal(err)
	}
	err = router.AddHandler(onceflow.Handler{
		Name:       "ledger",
		Topic:      "payments",
		Subscriber: gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}),
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
