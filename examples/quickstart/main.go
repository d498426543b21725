// Quickstart runs onceflow on the embedded default, with no service to set up: a durable
// SQLite queue as the broker and a separate SQLite file as the application database.
//
// It publishes payment messages, some of them twice (as a broker redelivers after a lost ack),
// and one with a malformed payload; an ExactlyOnce handler books each payment into a ledger
// table that has no unique key of its own. At the end it counts the ledger rows: one per
// distinct payment, however many times each was delivered, and the malformed message on the
// dead-letter topic with its reason.
//
//	go run ./examples/quickstart             # files in a new temporary directory
//	go run ./examples/quickstart -dir data   # files in ./data, kept
//	go run ./examples/quickstart -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/quickstart -db 'mysql://root@127.0.0.1:3306/test'
//
// With -db the ledger is in a schema (PostgreSQL) or database (MariaDB) of the run's own,
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
	"github.com/onceflow/onceflow/examples/internal/scratch"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// Summary is what a run measured.
type Summary struct {
	Distinct     int   // distinct payment messages published
	Deliveries   int   // messages published, duplicates included
	LedgerRows   int   // effects in the database
	DeadLettered int64 // messages on the dead-letter topic
	Reason       string
}

func main() {
	dir := flag.String("dir", "", "directory for queue.db and app.db (default: a new temporary directory)")
	dbURL := flag.String("db", "", "database URL: postgres://..., mysql://... (default: app.db beside the queue)")
	n := flag.Int("n", 1000, "distinct payments to publish")
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
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func report(w io.Writer, dir string, s Summary) {
	if dir == "" {
		fmt.Fprintln(w, "queue in a temporary directory, removed at exit (-dir DIR keeps it)")
	} else {
		fmt.Fprintf(w, "queue in %s\n", dir)
	}
	fmt.Fprintf(w, "published %d deliveries of %d distinct payments (%d redelivered copies) and 1 malformed message\n",
		s.Deliveries, s.Distinct, s.Deliveries-s.Distinct)
	fmt.Fprintf(w, "ledger rows: %d (one per payment: exactly once)\n", s.LedgerRows)
	fmt.Fprintf(w, "dead-lettered: %d (%s)\n", s.DeadLettered, s.Reason)
}

// run publishes to a queue in dir and books into the database of dbURL.
func run(ctx context.Context, dir, dbURL string, n int, logger *slog.Logger) (Summary, error) {
	queue, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), sqlitequeue.Config{ConsumerGroup: "ledger"})
	if err != nil {
		return Summary{}, err
	}
	defer queue.Close()
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return Summary{}, err
	}
	defer db.Close()
	if err := createLedger(ctx, db); err != nil {
		return Summary{}, err
	}

	// Publish every payment once, every tenth a second time, and one message that is not JSON.
	pub := queue.Publisher()
	s := Summary{Distinct: n}
	var batch []*message.Message
	for i := range n {
		body, _ := json.Marshal(Payment{Account: fmt.Sprintf("acct-%d", i%7), Cents: int64(100 + i)})
		id := fmt.Sprintf("payment-%06d", i)
		batch = append(batch, message.NewMessage(id, body))
		if i%10 == 0 {
			batch = append(batch, message.NewMessage(id, body))
		}
	}
	batch = append(batch, message.NewMessage("payment-malformed", []byte(`{"account": "acct-1", "cents": `)))
	s.Deliveries = len(batch) - 1
	if err := pub.Publish(topic, batch...); err != nil {
		return s, err
	}

	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: queue.Publisher(), Logger: logger})
	if err != nil {
		return s, err
	}
	sub, err := queue.Subscriber()
	if err != nil {
		return s, err
	}
	if err := router.AddHandler(ledgerHandler(sub, db)); err != nil {
		return s, err
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	if err := waitDrained(ctx, queue, done); err != nil {
		stop()
		return s, errors.Join(err, <-done)
	}
	stop()
	if err := <-done; err != nil {
		return s, err
	}

	if err := db.GetContext(ctx, &s.LedgerRows, `SELECT COUNT(*) FROM ledger`); err != nil {
		return s, err
	}
	if s.DeadLettered, err = queue.Len(ctx, onceflow.DefaultDeadLetterTopic); err != nil {
		return s, err
	}
	dead, err := queue.List(ctx, onceflow.DefaultDeadLetterTopic, 0, 1)
	if err != nil {
		return s, err
	}
	if len(dead) > 0 {
		s.Reason = dead[0].Message.Metadata.Get(messagedata.HeaderDeadLetterReason)
	}
	return s, nil
}

// waitDrained returns once the handler's consumer group has acknowledged every message.
func waitDrained(ctx context.Context, queue *sqlitequeue.Queue, done <-chan error) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(2 * time.Minute)
	for {
		select {
		case err := <-done:
			return fmt.Errorf("router stopped early: %w", err)
		case <-deadline:
			return errors.New("messages were not all processed within 2 minutes")
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			left, err := queue.Backlog(ctx, topic, "ledger")
			if err != nil {
				return err
			}
			if left == 0 {
				return nil
			}
		}
	}
}
