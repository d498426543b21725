// Payments is the payment scenario of "Reliable JMS with Transactions" (docs/background.md):
// payment orders arrive on a RabbitMQ queue and are booked
// into PostgreSQL, exactly once, without XA.
//
// Each order moves money between two accounts. The handler runs with the ExactlyOnce quality
// of service: the order id is recorded in the same transaction as the two balance updates, and
// the RabbitMQ message is acknowledged only after the commit. The example then shows the crash
// window that tech tip warns about: for some orders it reports a failure after the commit, as if the
// process died before its acknowledgement reached the broker. RabbitMQ delivers those orders
// again; their ids are found recorded and they are acknowledged without moving money twice.
//
//	go run ./examples/payments       # the embedded default: SQLite queue and database, temporary directory
//	go run ./examples/payments -broker amqp://guest:guest@127.0.0.1:5672/ -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/payments -broker amqp://guest:guest@127.0.0.1:5672/ -db 'mysql://root@127.0.0.1:3306/test'
//
// Any broker URL and database URL onceflow supports work; the tech tip's pair is RabbitMQ and
// PostgreSQL. With -db the tables are in a schema (PostgreSQL) or database (MariaDB) of the
// run's own, dropped at exit; the topic is the run's own too.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
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
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/all"
	"github.com/onceflow/onceflow/examples/internal/scratch"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// Order is a payment order: move Cents from one account to another.
type Order struct {
	From  string `json:"from"`
	To    string `json:"to"`
	Cents int64  `json:"cents"`
}

// Options configure a run.
type Options struct {
	BrokerURL string
	DBURL     string
	Orders    int // distinct payment orders
	LostAcks  int // orders whose first acknowledgement is lost after the commit
}

// Summary is what a run measured.
type Summary struct {
	Orders      int
	Redelivered int            // deliveries after a lost acknowledgement
	Payments    int            // rows in payments
	Balances    map[string]int // final balance per account, in cents
	Expected    map[string]int // what the orders add up to, each applied once
}

func main() {
	var o Options
	flag.StringVar(&o.BrokerURL, "broker", "", "broker URL: amqp://..., nats://... (default: an SQLite queue in a temporary directory)")
	flag.StringVar(&o.DBURL, "db", "", "database URL: postgres://..., mysql://... (default: SQLite in a temporary directory)")
	flag.IntVar(&o.Orders, "orders", 500, "payment orders to send")
	flag.IntVar(&o.LostAcks, "lost-acks", 50, "orders whose first acknowledgement is lost after the commit")
	flag.Parse()
	var s Summary
	err := scratch.Run("", o.DBURL, func(ctx context.Context, dir, runURL string) (err error) {
		o.DBURL = runURL
		if o.BrokerURL == "" {
			o.BrokerURL = "sqlite://" + filepath.Join(dir, "queue.db")
		}
		s, err = run(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)))
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
	fmt.Printf("%d payment orders, %d of them delivered again after a lost acknowledgement\n", s.Orders, s.Redelivered)
	fmt.Printf("payments booked: %d\n", s.Payments)
	for _, acct := range accounts {
		fmt.Printf("  %-6s balance %8d cents (expected %8d)\n", acct, s.Balances[acct], s.Expected[acct])
	}
}

var accounts = []string{"alice", "bob", "carol", "dave"}

func run(ctx context.Context, o Options, logger *slog.Logger) (s Summary, err error) {
	// A topic of the run's own: a broker keeps what an earlier run left on its topic.
	topic := "payments_" + newID()
	db, err := sqldb.Open(ctx, o.DBURL)
	if err != nil {
		return Summary{}, err
	}
	defer db.Close()
	b, err := broker.Open(ctx, o.BrokerURL, broker.Options{ConsumerGroup: "payments"})
	if err != nil {
		return Summary{}, err
	}
	defer b.Close()

	for _, ddl := range []string{
		`CREATE TABLE accounts (account VARCHAR(32) PRIMARY KEY, cents BIGINT NOT NULL)`,
		`CREATE TABLE payments (order_id VARCHAR(64) NOT NULL, cents BIGINT NOT NULL)`,
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return Summary{}, err
		}
	}
	for _, a := range accounts {
		if _, err := db.ExecContext(ctx, db.Rebind(`INSERT INTO accounts (account, cents) VALUES (?, 0)`), a); err != nil {
			return Summary{}, err
		}
	}

	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher(), Logger: logger, PurgeInterval: -1})
	if err != nil {
		return Summary{}, err
	}
	// The crash window: after the commit, report a failure for the first delivery of some
	// orders, as a process that dies before its acknowledgement does. The router nacks, and
	// RabbitMQ delivers the order again.
	var mu sync.Mutex
	lost := map[string]bool{}
	redelivered := 0
	loseAck := onceflow.Use("lose-ack", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			mu.Lock()
			defer mu.Unlock()
			if seen, ok := lost[msg.ID]; ok && seen {
				redelivered++
			}
			if err == nil && msg.Header("lose-ack") == "yes" && !lost[msg.ID] {
				lost[msg.ID] = true
				return errors.New("process died after commit, before the ack")
			}
			return err
		})
	})
	sub, err := b.Subscriber()
	if err != nil {
		return Summary{}, err
	}
	debit := db.Rebind(`UPDATE accounts SET cents = cents - ? WHERE account = ?`)
	credit := db.Rebind(`UPDATE accounts SET cents = cents + ? WHERE account = ?`)
	book := db.Rebind(`INSERT INTO payments (order_id, cents) VALUES (?, ?)`)
	err = router.AddHandler(onceflow.Handler{
		Name:       "payments",
		Topic:      topic,
		Subscriber: sub,
		DB:         db,
		// The ExactlyOnce chain, with the lost acknowledgement placed outside the retry: after
		// the commit, before the ack, its failure goes to the router, which nacks.
		Chain:       onceflow.ExactlyOnce.Chain().Before(onceflow.StageRetry, loseAck),
		Concurrency: 4,
		Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, o Order) error {
			if o.Cents <= 0 || o.From == o.To {
				return processor.Permanent(fmt.Errorf("invalid order: %+v", o))
			}
			tx, _ := processor.TxFromContext(ctx)
			if _, err := tx.ExecContext(ctx, debit, o.Cents, o.From); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, credit, o.Cents, o.To); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, book, msg.ID, o.Cents)
			return err
		}),
	})
	if err != nil {
		return Summary{}, err
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	select {
	case <-router.Running():
	case err := <-done:
		return Summary{}, err
	}

	s = Summary{Orders: o.Orders, Balances: map[string]int{}, Expected: map[string]int{}}
	var msgs []*message.Message
	for i := range o.Orders {
		ord := Order{From: accounts[i%len(accounts)], To: accounts[(i+1)%len(accounts)], Cents: int64(100 + i)}
		s.Expected[ord.From] -= int(ord.Cents)
		s.Expected[ord.To] += int(ord.Cents)
		body, _ := json.Marshal(ord)
		m := message.NewMessage(fmt.Sprintf("order-%05d", i), body)
		if i < o.LostAcks {
			m.Metadata.Set("lose-ack", "yes")
		}
		msgs = append(msgs, m)
	}
	if err := b.Publisher().Publish(topic, msgs...); err != nil {
		return s, err
	}

	deadline := time.Now().Add(2 * time.Minute)
	for {
		if err := db.GetContext(ctx, &s.Payments, `SELECT COUNT(*) FROM payments`); err != nil {
			return s, err
		}
		mu.Lock()
		r := redelivered
		mu.Unlock()
		if s.Payments >= o.Orders && r >= o.LostAcks {
			break
		}
		if time.Now().After(deadline) {
			return s, fmt.Errorf("after 2 minutes: %d of %d orders booked, %d of %d redeliveries seen", s.Payments, o.Orders, r, o.LostAcks)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		return s, err
	}
	mu.Lock()
	s.Redelivered = redelivered
	mu.Unlock()
	if err := db.GetContext(ctx, &s.Payments, `SELECT COUNT(*) FROM payments`); err != nil {
		return s, err
	}
	rows, err := db.QueryxContext(ctx, `SELECT account, cents FROM accounts`)
	if err != nil {
		return s, err
	}
	defer rows.Close()
	for rows.Next() {
		var a string
		var c int
		if err := rows.Scan(&a, &c); err != nil {
			return s, err
		}
		s.Balances[a] = c
	}
	return s, rows.Err()
}

func newID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
