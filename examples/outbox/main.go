// Outbox runs the exactly-once chain across two handlers on the embedded default: a durable
// SQLite queue as the broker and a separate SQLite file as the application database.
//
// Handler "orders" books each order and, in the same transaction, publishes a shipment request
// through the transactional outbox. A relay moves the outbox to the queue; to show what
// at-least-once costs, its broker "loses the confirmation" of every tenth message, so the relay
// sends that message again. Handler "shipping" books each shipment. Some orders are also
// published twice, as a broker redelivers after a lost ack. At the end it counts: one order
// row and one shipment row per distinct order, however many copies travelled.
//
//	go run ./examples/outbox             # files in a new temporary directory
//	go run ./examples/outbox -dir data   # files in ./data, kept
//	go run ./examples/outbox -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/outbox -db 'mysql://root@127.0.0.1:3306/test'
//
// With -db the tables are in a schema (PostgreSQL) or database (MariaDB) of the run's own,
// dropped at exit; the queue stays an SQLite file.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/examples/internal/scratch"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

const (
	ordersTopic    = "orders"
	shipmentsTopic = "shipments"
	consumerGroup  = "example"
)

// Summary is what a run measured.
type Summary struct {
	Orders        int   // distinct orders published
	Deliveries    int   // order messages published, redelivered copies included
	Relayed       int   // shipment messages the relay published, resends included
	OrderRows     int   // effects of handler "orders"
	ShipmentRows  int   // effects of handler "shipping"
	OutboxBacklog int64 // shipment requests not yet relayed at the end
}

func main() {
	dir := flag.String("dir", "", "directory for queue.db and app.db (default: a new temporary directory)")
	dbURL := flag.String("db", "", "database URL: postgres://..., mysql://... (default: app.db beside the queue)")
	n := flag.Int("n", 200, "distinct orders to publish")
	flag.Parse()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	err := scratch.Run(*dir, *dbURL, func(ctx context.Context, runDir, runURL string) error {
		s, err := run(ctx, runDir, runURL, *n, logger)
		if err == nil {
			report(os.Stdout, *dir, s)
		}
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox:", err)
		os.Exit(1)
	}
}

func report(w io.Writer, dir string, s Summary) {
	if dir == "" {
		fmt.Fprintln(w, "queue in a temporary directory, removed at exit (-dir DIR keeps it)")
	} else {
		fmt.Fprintf(w, "queue in %s\n", dir)
	}
	fmt.Fprintf(w, "published %d order messages for %d distinct orders\n", s.Deliveries, s.Orders)
	fmt.Fprintf(w, "relay published %d shipment messages (%d sent again after a lost confirmation)\n", s.Relayed, s.Relayed-s.Orders)
	fmt.Fprintf(w, "order rows: %d, shipment rows: %d (one each per order: exactly once)\n", s.OrderRows, s.ShipmentRows)
	fmt.Fprintf(w, "outbox backlog: %d\n", s.OutboxBacklog)
}

// lossyBroker publishes to the queue, then reports every tenth message as failed, as a broker
// whose confirmation is lost on the way back.
type lossyBroker struct {
	message.Publisher
	mu    sync.Mutex
	count int
}

func (b *lossyBroker) Publish(topic string, msgs ...*message.Message) error {
	if err := b.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	lost := false
	for range msgs {
		b.count++
		lost = lost || b.count%10 == 0
	}
	if lost {
		return errors.New("confirmation lost")
	}
	return nil
}

func (b *lossyBroker) published() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.count
}

// run publishes to a queue in dir, and books and ships in the database of dbURL.
func run(ctx context.Context, dir, dbURL string, n int, logger *slog.Logger) (Summary, error) {
	s := Summary{Orders: n}
	queue, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), sqlitequeue.Config{ConsumerGroup: consumerGroup})
	if err != nil {
		return s, err
	}
	defer queue.Close()
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return s, err
	}
	defer db.Close()
	for _, ddl := range []string{
		`CREATE TABLE IF NOT EXISTS orders (order_id VARCHAR(64) NOT NULL)`,
		`CREATE TABLE IF NOT EXISTS shipments (order_id VARCHAR(64) NOT NULL)`,
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return s, err
		}
	}

	// Publish every order once, every fifth a second time.
	var batch []*message.Message
	for i := range n {
		id := fmt.Sprintf("order-%05d", i)
		batch = append(batch, message.NewMessage(id, []byte(id)))
		if i%5 == 0 {
			batch = append(batch, message.NewMessage(id, []byte(id)))
		}
	}
	s.Deliveries = len(batch)
	if err := queue.Publisher().Publish(ordersTopic, batch...); err != nil {
		return s, err
	}

	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		return s, err
	}
	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: queue.Publisher(), Logger: logger})
	if err != nil {
		return s, err
	}
	router.AddMigration(ob.Migrate)
	handlers := []onceflow.Handler{{
		Name:  "orders",
		Topic: ordersTopic,
		Processor: processor.Func(func(ctx context.Context, md *messagedata.MessageData) error {
			tx, _ := processor.TxFromContext(ctx)
			if _, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO orders (order_id) VALUES (?)`), md.ID); err != nil {
				return err
			}
			ship := message.NewMessage(outbox.DerivedID(md.ID, "ship"), md.Payload)
			return ob.Publish(ctx, shipmentsTopic, ship)
		}),
	}, {
		Name:  "shipping",
		Topic: shipmentsTopic,
		Processor: processor.Func(func(ctx context.Context, md *messagedata.MessageData) error {
			tx, _ := processor.TxFromContext(ctx)
			_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO shipments (order_id) VALUES (?)`), string(md.Payload))
			return err
		}),
	}}
	for _, h := range handlers {
		sub, err := queue.Subscriber()
		if err != nil {
			return s, err
		}
		h.Subscriber, h.DB, h.QoS = sub, db, onceflow.ExactlyOnce
		if err := router.AddHandler(h); err != nil {
			return s, err
		}
	}
	broker := &lossyBroker{Publisher: queue.Publisher()}
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB:             db,
		Publisher:      broker,
		PollInterval:   20 * time.Millisecond,
		ResendInterval: 20 * time.Millisecond,
		Logger:         logger,
	})
	if err != nil {
		return s, err
	}

	runCtx, stop := context.WithCancel(ctx)
	routerDone, relayDone := make(chan error, 1), make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	select {
	case <-router.Running(): // the router has migrated the outbox
	case err := <-routerDone:
		stop()
		return s, fmt.Errorf("router: %w", err)
	}
	go func() { relayDone <- relay.Run(runCtx) }()
	waitErr := waitDone(ctx, queue, relay, routerDone)
	stop()
	if err := errors.Join(waitErr, <-routerDone, <-relayDone); err != nil {
		return s, err
	}

	s.Relayed = broker.published()
	if err := db.GetContext(ctx, &s.OrderRows, `SELECT COUNT(*) FROM orders`); err != nil {
		return s, err
	}
	if err := db.GetContext(ctx, &s.ShipmentRows, `SELECT COUNT(*) FROM shipments`); err != nil {
		return s, err
	}
	st, err := relay.Stats(ctx)
	s.OutboxBacklog = st.Backlog
	return s, err
}

// waitDone returns once both topics are consumed and the outbox is relayed.
func waitDone(ctx context.Context, queue *sqlitequeue.Queue, relay *outbox.Relay, routerDone <-chan error) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(2 * time.Minute)
	for {
		select {
		case err := <-routerDone:
			return fmt.Errorf("router stopped early: %w", err)
		case <-deadline:
			return errors.New("messages were not all processed within 2 minutes")
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		st, err := relay.Stats(ctx)
		if err != nil {
			return err
		}
		left := st.Backlog
		for _, topic := range []string{ordersTopic, shipmentsTopic} {
			n, err := queue.Backlog(ctx, topic, consumerGroup)
			if err != nil {
				return err
			}
			left += n
		}
		if left == 0 {
			return nil
		}
	}
}
