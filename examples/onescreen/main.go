// Onescreen is the program of the README's "In one screen": a service that books payments
// from a queue into a ledger table exactly once, on the embedded default (SQLite as the queue
// and as the database, nothing to install). -demo publishes two payments first, one of them
// twice as a broker redelivers after a lost acknowledgement: it is booked once.
//
//	go run ./examples/onescreen -demo    # Ctrl-C stops it; run it again: nothing is booked twice
//	go run ./examples/onescreen -demo -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"os/signal"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql" // the drivers of the databases it opens
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

type Payment struct {
	Cents int64 `json:"cents"`
}

func main() {
	dbURL := flag.String("db", "sqlite://app.db", "database URL: sqlite://, postgres://, mysql://")
	demo := flag.Bool("demo", false, "publish two payments, one of them twice, before consuming")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, "sqlite://queue.db", *dbURL, *demo); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, queueURL, dbURL string, demo bool) error {
	queue, err := sqlitequeue.Open(ctx, queueURL, sqlitequeue.Config{})
	if err != nil {
		return err
	}
	defer queue.Close()
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS ledger (payment_id VARCHAR(64) NOT NULL, cents BIGINT NOT NULL)`); err != nil {
		return err
	}
	if demo {
		first, second := `{"cents": 1250}`, `{"cents": 990}`
		err := queue.Publisher().Publish("payments", message.NewMessage("pay-1", []byte(first)),
			message.NewMessage("pay-2", []byte(second)), message.NewMessage("pay-2", []byte(second)))
		if err != nil {
			return err
		}
	}

	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: queue.Publisher()})
	if err != nil {
		return err
	}
	sub, err := queue.Subscriber()
	if err != nil {
		return err
	}
	err = router.AddHandler(onceflow.Handler{
		Name:       "ledger",
		Topic:      "payments",
		Subscriber: sub,
		DB:         db,
		QoS:        onceflow.ExactlyOnce, // the message id is recorded in the same transaction
		Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, p Payment) error {
			log.Printf("booking %s: %d cents", msg.ID, p.Cents)
			tx, _ := processor.TxFromContext(ctx) // opened, committed and rolled back by onceflow
			_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO ledger (payment_id, cents) VALUES (?, ?)`), msg.ID, p.Cents)
			return err
		}),
	})
	if err != nil {
		return err
	}
	return router.Run(ctx) // until ctx ends; each message is acknowledged after its commit
}
