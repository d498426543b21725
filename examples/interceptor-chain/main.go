// Interceptor-chain is the classic interceptor stack (docs/background.md) in code: the canonical
// ExactlyOnce chain of the library with one interceptor of this program's own put in by
// position, and the duplicate-handling advisor's message_log table keyed by message id and
// timestamp. One line makes the chain:
//
//	onceflow.ExactlyOnce.Chain().Before(onceflow.StageDeadLetter, onceflow.Use("audit", audit))
//
// which runs, outermost first:
//
//	tracing -> metrics -> audit -> deadletter -> recover -> retry -> timeout -> transaction -> deduplicate
//
// "tracing" is the trace advisor (an OpenTelemetry span per message), "metrics" the performance
// monitor (OpenTelemetry counters and a duration histogram), "deduplicate" the
// duplicate-handling advisor writing to message_log in the processor's transaction, and "audit"
// this program's interceptor: outside the dead-letter stage, it sees each delivery once with
// its final outcome. Every stage it does not touch stays the library's. Stages run in the order
// given: the first is the outermost, so it sees the message first and the outcome last.
//
//	go run ./examples/interceptor-chain
//	go run ./examples/interceptor-chain -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run ./examples/interceptor-chain -db 'mysql://root@127.0.0.1:3306/test'
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
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
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
	topic = "orders"
	group = "orders"
)

// Summary is what a run observed.
type Summary struct {
	Chain      string           // the handler's chain, outermost first
	Audit      []string         // the audit interceptor's log, one line per delivery
	Orders     int              // rows the processor wrote
	MessageLog int              // rows in message_log
	Spans      []string         // names of the spans recorded, sorted
	ByOutcome  map[string]int64 // onceflow.messages by outcome
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
		fmt.Fprintln(os.Stderr, "interceptor-chain:", err)
		os.Exit(1)
	}
	fmt.Println("chain:", s.Chain)
	for _, line := range s.Audit {
		fmt.Println(line)
	}
	fmt.Printf("orders: %d, message_log rows: %d\n", s.Orders, s.MessageLog)
	fmt.Printf("performance monitor: %v\n", s.ByOutcome)
	counts := map[string]int{}
	for _, name := range s.Spans {
		counts[name]++
	}
	fmt.Printf("trace advisor spans: %v\n", counts)
}

// run consumes from a queue in dir and writes to the database of dbURL.
func run(ctx context.Context, dir, dbURL string, logger *slog.Logger) (Summary, error) {
	// One message in flight at a time, so that the audit lines come in publishing order.
	queue, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), sqlitequeue.Config{ConsumerGroup: group, BatchSize: 1})
	if err != nil {
		return Summary{}, err
	}
	defer queue.Close()
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return Summary{}, err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (order_id VARCHAR(64) NOT NULL, body VARCHAR(255) NOT NULL)`); err != nil {
		return Summary{}, err
	}

	// Three orders, the second delivered twice with the same id and timestamp (a redelivery).
	ts := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	var msgs []*message.Message
	for i, id := range []string{"order-1", "order-2", "order-2", "order-3"} {
		m := message.NewMessage(id, []byte(fmt.Sprintf(`{"n":%d}`, i)))
		m.Metadata.Set(messagedata.HeaderTimestamp, ts.Format(time.RFC3339Nano))
		msgs = append(msgs, m)
	}
	if err := queue.Publisher().Publish(topic, msgs...); err != nil {
		return Summary{}, err
	}

	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(ctx)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(ctx)

	router, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: queue.Publisher(),
		Logger:              logger,
		TracerProvider:      tp,
		MeterProvider:       mp,
	})
	if err != nil {
		return Summary{}, err
	}
	var mu sync.Mutex
	var audit []string
	// The interceptor: it sees each delivery and its outcome, and could write an audit row
	// through processor.TxFromContext if placed inside the transaction (After(StageTransaction)).
	auditStage := onceflow.Use("audit", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			d, _ := middleware.DeliveryFrom(ctx)
			mu.Lock()
			audit = append(audit, fmt.Sprintf("audit: handler=%s message=%s outcome=%s", d.Handler(), msg.ID, processor.OutcomeOf(err)))
			mu.Unlock()
			return err
		})
	})
	chain := onceflow.ExactlyOnce.Chain().Before(onceflow.StageDeadLetter, auditStage)
	sub, err := queue.Subscriber()
	if err != nil {
		return Summary{}, err
	}
	err = router.AddHandler(onceflow.Handler{
		Name:       "orders",
		Topic:      topic,
		Subscriber: sub,
		DB:         db,
		Chain:      chain,
		Dedup:      middleware.Dedup{Table: "message_log", WithTimestamp: true},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, _ := processor.TxFromContext(ctx)
			_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO orders (order_id, body) VALUES (?, ?)`), msg.ID, string(msg.Payload))
			return err
		}),
	})
	if err != nil {
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

	s := Summary{Chain: chain.String(), Audit: audit, ByOutcome: map[string]int64{}}
	if err := db.GetContext(ctx, &s.Orders, `SELECT COUNT(*) FROM orders`); err != nil {
		return s, err
	}
	if err := db.GetContext(ctx, &s.MessageLog, `SELECT COUNT(*) FROM message_log`); err != nil {
		return s, err
	}
	for _, sp := range spans.Ended() {
		s.Spans = append(s.Spans, sp.Name())
	}
	sort.Strings(s.Spans)
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		return s, err
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "onceflow.messages" {
				for _, dp := range sum.DataPoints {
					if dp.Value == 0 {
						continue // every outcome's series exists from the start, at 0
					}
					outcome, _ := dp.Attributes.Value("onceflow.outcome")
					s.ByOutcome[outcome.AsString()] += dp.Value
				}
			}
		}
	}
	return s, nil
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
