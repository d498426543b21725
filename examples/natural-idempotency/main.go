// Natural-idempotency shows messages processed exactly once without a dedup
// table, because the business writes themselves fail in a recognisable way on a second
// delivery.
//
//   - A "payment received" message INSERTs a row keyed by the payment id. Delivered again, the
//     INSERT violates the primary key; the natural-idempotency interceptor recognises the unique
//     violation of that one constraint (Handler.Dedup.UniqueConstraints; a violation of any
//     other unique key would be a conflict with another row, and dead-lettered) and the message
//     is acknowledged as already processed.
//   - A "balance set" message UPDATEs an account WHERE its version is the one before the
//     message's. When the UPDATE touches zero rows, processor.CheckVersion reads why: the stored
//     version is at or past the message's (delivered again: already processed), or behind it by
//     more than one (the message came before its predecessor: it is redelivered after a short
//     delay, by when its predecessor has been applied).
//
// The transaction is rolled back in both cases (on PostgreSQL the violation has aborted it) and
// the message is acked after that: nothing is applied twice and nothing is lost.
//
//	go run ./examples/natural-idempotency                     # embedded SQLite, temporary directory
//	go run ./examples/natural-idempotency -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/natural-idempotency -db 'mysql://root@127.0.0.1:3306/test'
//
// With -db the tables are in a schema (PostgreSQL) or database (MariaDB) of the run's own,
// dropped at exit; the queue stays an SQLite file.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/examples/internal/scratch"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

const (
	topic = "accounting"
	group = "accounting"
)

// Event is the message payload: either a payment or a new balance for an account.
type Event struct {
	Kind    string `json:"kind"` // "payment" or "balance"
	ID      string `json:"id"`   // payment id or account id
	Cents   int64  `json:"cents"`
	Version int64  `json:"version"` // for "balance": the account version this message creates
}

// Summary is what a run measured.
type Summary struct {
	Deliveries   int   // messages delivered: every distinct message twice
	Payments     int   // payment rows
	Balances     []int // version of each account at the end
	DedupTable   bool  // whether a dedup table exists (it must not)
	DeadLettered int64 // messages on the dead-letter topic (none: duplicates are acked)
}

func main() {
	dbURL := flag.String("db", "", "database URL: postgres://..., mysql://... (default: SQLite beside the queue)")
	flag.Parse()
	var s Summary
	err := scratch.Run("", *dbURL, func(ctx context.Context, dir, runURL string) (err error) {
		s, err = run(ctx, dir, runURL, slog.New(slog.NewTextHandler(io.Discard, nil)))
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "natural-idempotency:", err)
		os.Exit(1)
	}
	fmt.Printf("delivered %d messages: %d distinct, each twice\n", s.Deliveries, s.Deliveries/2)
	fmt.Printf("payment rows: %d; account versions: %v; dead-lettered: %d; dedup table present: %v\n",
		s.Payments, s.Balances, s.DeadLettered, s.DedupTable)
}

// run consumes from a queue in dir and writes to the database of dbURL.
func run(ctx context.Context, dir, dbURL string, logger *slog.Logger) (s Summary, err error) {
	// Several messages in flight: a later version may be processed before an earlier one, and
	// comes back after its redelivery delay.
	queue, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), sqlitequeue.Config{ConsumerGroup: group})
	if err != nil {
		return Summary{}, err
	}
	defer queue.Close()
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return Summary{}, err
	}
	defer db.Close()
	for _, ddl := range []string{
		`CREATE TABLE natural_payments (payment_id VARCHAR(64) PRIMARY KEY, cents BIGINT NOT NULL)`,
		`CREATE TABLE natural_accounts (account_id VARCHAR(64) PRIMARY KEY, cents BIGINT NOT NULL, version BIGINT NOT NULL)`,
		`INSERT INTO natural_accounts (account_id, cents, version) VALUES ('acct-1', 0, 0), ('acct-2', 0, 0)`,
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return Summary{}, err
		}
	}

	// Every message is published twice, as a broker redelivers after a lost acknowledgement.
	events := []Event{
		{Kind: "payment", ID: "pay-1", Cents: 500},
		{Kind: "payment", ID: "pay-2", Cents: 700},
		{Kind: "balance", ID: "acct-1", Cents: 500, Version: 1},
		{Kind: "balance", ID: "acct-1", Cents: 1200, Version: 2},
		{Kind: "balance", ID: "acct-2", Cents: 50, Version: 1},
	}
	var msgs []*message.Message
	for i, e := range events {
		body, _ := json.Marshal(e)
		id := fmt.Sprintf("event-%d", i)
		msgs = append(msgs, message.NewMessage(id, body), message.NewMessage(id, body))
	}
	if err := queue.Publisher().Publish(topic, msgs...); err != nil {
		return Summary{}, err
	}

	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: queue.Publisher(), Logger: logger})
	if err != nil {
		return Summary{}, err
	}
	sub, err := queue.Subscriber()
	if err != nil {
		return Summary{}, err
	}
	if err := router.AddHandler(onceflow.Handler{
		Name:       "accounting",
		Topic:      topic,
		Subscriber: sub,
		DB:         db,
		QoS:        onceflow.ExactlyOnce,
		// No dedup table: the business writes detect the second delivery themselves, by the
		// primary key of natural_payments, as each database names it.
		Dedup:       middleware.Dedup{Mode: middleware.DedupNatural, UniqueConstraints: []string{"natural_payments_pkey", "PRIMARY", "natural_payments.payment_id"}},
		Concurrency: 4,
		// A balance that arrives before its predecessor is tried again soon.
		Retry:      middleware.Retry{MaxAttempts: 1},
		Redelivery: onceflow.RedeliveryConfig{Delays: []time.Duration{20 * time.Millisecond}},
		Processor:  processor.JSON(apply),
	}); err != nil {
		return Summary{}, err
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	if err := waitDrained(ctx, queue, done); err != nil {
		stop()
		return Summary{}, errors.Join(err, <-done)
	}
	stop()
	if err := <-done; err != nil {
		return Summary{}, err
	}

	s = Summary{Deliveries: len(msgs)}
	if err := db.GetContext(ctx, &s.Payments, `SELECT COUNT(*) FROM natural_payments`); err != nil {
		return s, err
	}
	if err := db.SelectContext(ctx, &s.Balances, `SELECT version FROM natural_accounts ORDER BY account_id`); err != nil {
		return s, err
	}
	if s.DedupTable, err = db.TableExists(ctx, dedup.DefaultTable); err != nil {
		return s, err
	}
	s.DeadLettered, err = queue.Len(ctx, onceflow.DefaultDeadLetterTopic)
	return s, err
}

// apply is the processor: an INSERT keyed by the payment id, or a version-checked UPDATE.
func apply(ctx context.Context, msg *messagedata.MessageData, e Event) error {
	tx, _ := processor.TxFromContext(ctx)
	switch e.Kind {
	case "payment":
		// A second delivery violates the primary key: the natural-idempotency interceptor
		// turns that into "already processed".
		_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO natural_payments (payment_id, cents) VALUES (?, ?)`), e.ID, e.Cents)
		return err
	case "balance":
		res, err := tx.ExecContext(ctx, tx.Rebind(`UPDATE natural_accounts SET cents = ?, version = ? WHERE account_id = ? AND version = ?`),
			e.Cents, e.Version, e.ID, e.Version-1)
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 1 {
			return err
		}
		var stored int64
		if err := tx.GetContext(ctx, &stored, tx.Rebind(`SELECT version FROM natural_accounts WHERE account_id = ?`), e.ID); err != nil {
			return err
		}
		return processor.CheckVersion(stored, e.Version)
	}
	return processor.Permanent(fmt.Errorf("unknown event kind %q", e.Kind))
}

func waitDrained(ctx context.Context, queue *sqlitequeue.Queue, done <-chan error) error {
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		select {
		case err := <-done:
			return fmt.Errorf("router stopped early: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		left, err := queue.Backlog(ctx, topic, group)
		if err != nil {
			return err
		}
		if left == 0 {
			return nil
		}
	}
	return errors.New("messages were not all processed within a minute")
}
