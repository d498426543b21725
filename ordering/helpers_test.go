package ordering_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// t0 is the time the tests' clocks start at.
var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

const (
	handlerName = "ledger"
	dlqTopic    = "dead"
	appliedT    = "applied"
	runID       = "run"
	gapTimeout  = 5 * time.Minute
)

// clock is a settable Config.Now.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// deadLetters records what is published to it.
type deadLetters struct {
	mu   sync.Mutex
	msgs []*message.Message
	// refuse, when set, may refuse a message, as a failing dead-letter broker does.
	refuse func(*message.Message) error
}

func (d *deadLetters) Publish(topic string, msgs ...*message.Message) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, m := range msgs {
		if d.refuse != nil {
			if err := d.refuse(m); err != nil {
				return err
			}
		}
		if topic != dlqTopic {
			return fmt.Errorf("dead letter published to %q", topic)
		}
		d.msgs = append(d.msgs, m)
	}
	return nil
}

func (d *deadLetters) Close() error { return nil }

func (d *deadLetters) all() []*message.Message {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]*message.Message(nil), d.msgs...)
}

// env is one test's database, ordering store, dedup store and in-order chain. Its processor
// records each message it applies in the applied table (package ordercheck), after calling
// fail, when set, which may fail or panic.
type env struct {
	db     *sqldb.DB
	store  *ordering.Store
	dedup  *dedup.SQLStore
	io     *ordering.InOrder
	clock  *clock
	dlq    *deadLetters
	reader *sdkmetric.ManualReader
	chain  processor.Processor

	mu   sync.Mutex
	fail func(md *messagedata.MessageData) error
	seen map[string]*messagedata.MessageData // by id, as the processor saw it
}

// forEachDB runs test in parallel on a fresh database of every dialect.
func forEachDB(t *testing.T, cfg ordering.Config, test func(t *testing.T, e *env)) {
	t.Helper()
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			test(t, setup(t, d.Open(t), cfg))
		})
	}
}

var testLogger = func() *slog.Logger {
	if os.Getenv("ONCEFLOW_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}()

// setup migrates the tables on db and builds the chain Transaction -> Deduplicate -> InOrder.
func setup(t *testing.T, db *sqldb.DB, cfg ordering.Config) *env {
	t.Helper()
	ctx := context.Background()
	e := &env{db: db, clock: &clock{now: t0}, dlq: &deadLetters{}, reader: sdkmetric.NewManualReader(), seen: map[string]*messagedata.MessageData{}}
	var err error
	e.store, err = ordering.NewStore(db, ordering.StoreConfig{})
	require.NoError(t, err)
	require.NoError(t, e.store.Migrate(ctx))
	e.dedup, err = dedup.New(db, dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, e.dedup.Migrate(ctx))
	require.NoError(t, ordercheck.Create(ctx, db, appliedT))

	cfg.Handler = handlerName
	cfg.Now = e.clock.Now
	if cfg.GapTimeout == 0 {
		cfg.GapTimeout = gapTimeout
	}
	cfg.DeadLetterPublisher, cfg.DeadLetterTopic = e.dlq, dlqTopic
	cfg.Forget = func(ctx context.Context, tx sqlx.ExtContext, md *messagedata.MessageData) error {
		return e.dedup.Forget(ctx, tx, dedup.Key{Handler: handlerName, MessageID: md.ID})
	}
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.reader))
	cfg.Logger = testLogger
	e.io, err = ordering.New(e.store, cfg)
	require.NoError(t, err)

	proc := processor.Func(func(ctx context.Context, md *messagedata.MessageData) error {
		e.mu.Lock()
		fail := e.fail
		e.mu.Unlock()
		if fail != nil {
			if err := fail(md); err != nil {
				return err
			}
		}
		tx, ok := processor.TxFromContext(ctx)
		if !ok {
			return fmt.Errorf("no transaction")
		}
		if err := ordercheck.Record(ctx, tx, appliedT, runID, md.Key, md.Sequence, md.ID, 0); err != nil {
			return err
		}
		e.mu.Lock()
		e.seen[md.ID] = md
		e.mu.Unlock()
		return nil
	})
	e.chain = middleware.Chain(middleware.Transaction{}.Middleware(middleware.Pool(db)), must(middleware.Dedup{Store: e.dedup}.Middleware(nil, handlerName)), e.io.Middleware())(proc)
	return e
}

func (e *env) setFail(fn func(md *messagedata.MessageData) error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.fail = fn
}

// msg returns the message id of key's sequence seq, with a payload and headers of its own.
func msg(id, key string, seq uint64) *messagedata.MessageData {
	return &messagedata.MessageData{
		ID:        id,
		Topic:     "postings",
		Key:       key,
		Sequence:  seq,
		Timestamp: t0.Add(time.Duration(seq) * time.Second),
		Headers:   map[string]string{"source": "teller", messagedata.HeaderKey: key, messagedata.HeaderSequence: fmt.Sprint(seq)},
		Payload:   []byte(fmt.Sprintf(`{"key":%q,"seq":%d}`, key, seq)),
		Attempt:   1,
	}
}

// deliver runs the chain for message id, sequence seq of key.
func (e *env) deliver(id, key string, seq uint64) error {
	return e.chain.Process(context.Background(), msg(id, key, seq))
}

// mustDeliver delivers and requires a nil outcome (applied or parked).
func (e *env) mustDeliver(t *testing.T, id, key string, seq uint64) {
	t.Helper()
	require.NoError(t, e.deliver(id, key, seq), "deliver %s (%s #%d)", id, key, seq)
}

// applied returns "key#seq" of every applied message, in the order applied.
func (e *env) applied(t *testing.T) []string {
	t.Helper()
	var rows []ordercheck.Row
	require.NoError(t, e.db.Select(&rows, `SELECT id, order_key, seq FROM `+appliedT+` ORDER BY id`))
	out := []string{}
	for _, r := range rows {
		out = append(out, fmt.Sprintf("%s#%d", r.Key, r.Seq))
	}
	return out
}

func (e *env) stats(t *testing.T) ordering.Stats {
	t.Helper()
	st, err := e.io.Stats(context.Background())
	require.NoError(t, err)
	return st
}

func (e *env) sweep(t *testing.T) ordering.SweepResult {
	t.Helper()
	res, err := e.io.Sweep(context.Background())
	require.NoError(t, err)
	require.False(t, res.Locked)
	return res
}

// gapTimeouts returns the onceflow.order.gap_timeouts count for policy and cause.
func (e *env) gapTimeouts(t *testing.T, policy, cause string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, e.reader.Collect(context.Background(), &rm))
	want := attribute.NewSet(attribute.String("onceflow.handler", handlerName),
		ordering.AttrGapPolicy.String(policy), ordering.AttrGapCause.String(cause))
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "onceflow.order.gap_timeouts" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if dp.Attributes.Equals(&want) {
					return dp.Value
				}
			}
		}
	}
	return 0
}

// reasons returns the dead-letter reason of each message published to the dead-letter topic,
// by message id.
func (e *env) reasons() map[string]string {
	out := map[string]string{}
	for _, m := range e.dlq.all() {
		out[m.UUID] = m.Metadata.Get(messagedata.HeaderDeadLetterReason)
	}
	return out
}

// testDB returns a fresh SQLite database, for tests that need one of any dialect.
func testDB(t *testing.T) *sqldb.DB {
	t.Helper()
	return testsvc.SQLite(t)
}

// sweepErrors returns the onceflow.order.sweep_errors count of the handler.
func (e *env) sweepErrors(t *testing.T) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, e.reader.Collect(context.Background(), &rm))
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "onceflow.order.sweep_errors" {
				var n int64
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					n += dp.Value
				}
				return n
			}
		}
	}
	return 0
}

// must returns the middleware that its constructor made, and panics, failing the test, when
// the constructor refused its options.
func must(mw middleware.Middleware, err error) middleware.Middleware {
	if err != nil {
		panic(err)
	}
	return mw
}
