package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// printer stands in for the destination broker.
type printer struct {
	want int
	done chan struct{}
}

func (p *printer) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		fmt.Printf("sent to %s: %s, id %s\n", topic, m.Payload, m.UUID)
		if p.want--; p.want == 0 {
			close(p.done)
		}
	}
	return nil
}

func (p *printer) Close() error { return nil }

// A processor stores an order and announces it through the outbox, in the handler's
// transaction. What rolls back is never sent; what commits, the relay sends.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "onceflow-outbox-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE orders (id TEXT PRIMARY KEY)`); err != nil {
		log.Fatal(err)
	}

	ob, err := outbox.New(db, outbox.Config{}) // table onceflow_outbox
	if err != nil {
		log.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil { // with a Router: router.AddMigration(ob.Migrate)
		log.Fatal(err)
	}

	confirm := middleware.Transaction{}.Middleware(middleware.Pool(db))(processor.Func(func(ctx context.Context, md *messagedata.MessageData) error {
		tx, _ := processor.TxFromContext(ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id) VALUES (?)`, md.ID); err != nil {
			return err
		}
		// The outgoing id derives from the incoming one: a second processing of the same
		// order would publish the same id, which the consumers' deduplication absorbs.
		confirmed := message.NewMessage(outbox.DerivedID(md.ID, "confirmed"), []byte(md.ID+" confirmed"))
		if err := ob.Publish(ctx, "orders.confirmed", confirmed); err != nil {
			return err
		}
		if md.ID == "order-2" {
			return errors.New("payment declined") // the order and its message roll back
		}
		return nil
	}))
	for _, id := range []string{"order-1", "order-2", "order-3"} {
		if err := confirm.Process(ctx, &messagedata.MessageData{ID: id, Topic: "orders", Attempt: 1}); err != nil {
			fmt.Printf("%s: rolled back: %v\n", id, err)
			continue
		}
		fmt.Printf("%s: committed\n", id)
	}

	dest := &printer{want: 2, done: make(chan struct{})}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: dest, PollInterval: 10 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		if err := relay.Run(ctx); err != nil {
			log.Fatal(err)
		}
	}()
	<-dest.done
	if err := relay.Close(); err != nil {
		log.Fatal(err)
	}

	// Output:
	// order-1: committed
	// order-2: rolled back: payment declined
	// order-3: committed
	// sent to orders.confirmed: order-1 confirmed, id 0f286619-c9b1-5852-83f7-813293720856
	// sent to orders.confirmed: order-3 confirmed, id a51b23ac-4282-5eac-a851-4346711034fc
}
