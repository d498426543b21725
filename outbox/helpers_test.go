package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"

	_ "github.com/onceflow/onceflow/broker/all"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// waitTimeout bounds every wait of the tests.
const waitTimeout = 20 * time.Second

// topic is the destination topic of the tests' messages.
const topic = "orders.shipped"

// env is one test's application database and outbox.
type env struct {
	url string
	db  *sqldb.DB
	ob  *outbox.Outbox
}

// forEachDB runs test in parallel on a fresh database of every dialect, with a migrated outbox
// (table cfg.Table) and a business table orders.
func forEachDB(t *testing.T, cfg outbox.Config, test func(t *testing.T, e *env)) {
	t.Helper()
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			test(t, setup(t, d, cfg))
		})
	}
}

func setup(t *testing.T, d testsvc.Database, cfg outbox.Config) *env {
	t.Helper()
	url := d.URL(t)
	e := &env{url: url, db: open(t, url)}
	if cfg.Propagator == nil {
		cfg.Propagator = propagation.TraceContext{}
	}
	var err error
	e.ob, err = outbox.New(e.db, cfg)
	require.NoError(t, err)
	require.NoError(t, e.ob.Migrate(context.Background()))
	_, err = e.db.Exec(`CREATE TABLE orders (id VARCHAR(100) NOT NULL PRIMARY KEY)`)
	require.NoError(t, err)
	return e
}

// open opens url in a pool of its own, as another process would.
func open(t *testing.T, url string) *sqldb.DB {
	t.Helper()
	db, err := sqldb.Open(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// process runs a handler with the real Transaction middleware: it inserts the order
// incomingID and publishes msgs through the outbox, then returns fail. It returns what the
// chain returned.
func (e *env) process(ctx context.Context, incomingID string, fail error, msgs ...*message.Message) error {
	chain := middleware.Transaction{}.Middleware(middleware.Pool(e.db))(processor.Func(func(ctx context.Context, md *messagedata.MessageData) error {
		tx, _ := processor.TxFromContext(ctx)
		if _, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO orders (id) VALUES (?)`), md.ID); err != nil {
			return err
		}
		if err := e.ob.Publish(ctx, topic, msgs...); err != nil {
			return err
		}
		return fail
	}))
	return chain.Process(ctx, &messagedata.MessageData{ID: incomingID, Topic: "orders", Attempt: 1})
}

// inTx runs fn inside the real Transaction middleware, and commits when it returns nil.
func (e *env) inTx(ctx context.Context, fn func(ctx context.Context) error) error {
	chain := middleware.Transaction{}.Middleware(middleware.Pool(e.db))(processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
		return fn(ctx)
	}))
	return chain.Process(ctx, &messagedata.MessageData{ID: "in-tx", Topic: "orders", Attempt: 1})
}

// commitN processes n incoming messages "<prefix>-<i>", each in its own committed transaction
// that publishes one message, and returns the outgoing messages' ids in order.
func (e *env) commitN(t *testing.T, prefix string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range n {
		in := fmt.Sprintf("%s-%03d", prefix, i)
		ids[i] = outbox.DerivedID(in, "shipped")
		require.NoError(t, e.process(context.Background(), in, nil, message.NewMessage(ids[i], []byte(in))))
	}
	return ids
}

// relayConfig returns the tests' relay configuration for db and dest: short intervals, and
// no purge (tests that want it set PurgeInterval).
func relayConfig(e *env, db *sqldb.DB, dest message.Publisher) outbox.RelayConfig {
	return outbox.RelayConfig{
		DB:                db,
		Publisher:         dest,
		Table:             e.ob.Table(),
		PollInterval:      10 * time.Millisecond,
		ResendInterval:    10 * time.Millisecond,
		MaxResendInterval: 50 * time.Millisecond,
		RetryInterval:     50 * time.Millisecond,
		CloseTimeout:      10 * time.Second,
		PurgeInterval:     -1,
		Logger:            testLogger,
	}
}

// rows returns the number of rows in the outbox's messages table.
func (e *env) rows(t *testing.T) int {
	t.Helper()
	messages, _ := e.ob.Tables()
	var n int
	require.NoError(t, e.db.QueryRow(`SELECT COUNT(*) FROM `+e.db.Dialect.Quote(messages)).Scan(&n))
	return n
}

// testLogger discards the relays' logs, unless ONCEFLOW_TEST_LOG is set: the tests make
// publishes fail on purpose, which the relay logs as errors.
var testLogger = func() *slog.Logger {
	if os.Getenv("ONCEFLOW_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}()

// running is a relay that runs until the test ends.
type running struct {
	*outbox.Relay
	done chan error
}

// start runs a relay of cfg; it is closed when the test ends.
func start(t *testing.T, cfg outbox.RelayConfig) *running {
	t.Helper()
	r, err := outbox.NewRelay(cfg)
	require.NoError(t, err)
	return run(t, r)
}

func run(t *testing.T, r *outbox.Relay) *running {
	t.Helper()
	rr := &running{Relay: r, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(context.Background()) }()
	t.Cleanup(func() { _ = rr.stop(t) })
	return rr
}

// stop closes the relay and returns what Run returned.
func (r *running) stop(t *testing.T) error {
	t.Helper()
	closeErr := r.Close()
	select {
	case err := <-r.done:
		r.done <- err
		return errors.Join(err, closeErr)
	case <-time.After(waitTimeout):
		t.Fatalf("relay did not stop within %s", waitTimeout)
		return nil
	}
}

// waitStopped waits until Run has returned.
func (r *running) waitStopped(t *testing.T) {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err
	case <-time.After(waitTimeout):
		t.Fatalf("relay did not stop within %s", waitTimeout)
	}
}

// waitBacklog waits until the relay's consumer group has n messages left to send.
func waitBacklog(t *testing.T, ob *outbox.Outbox, group string, n int64) {
	t.Helper()
	testsvc.Eventually(t, waitTimeout, func() bool {
		st, err := ob.Stats(context.Background(), group)
		require.NoError(t, err)
		return st.Backlog == n
	}, "backlog of group %q never reached %d", group, n)
}

// sent is one message that reached the recorder.
type sent struct {
	topic string
	msg   *message.Message
	at    time.Time // when the recorder took it
}

// recorder is the destination broker: a message.Publisher that records what it is given.
// Its hooks, set before the relay starts, run for each message: before, with the number of
// earlier attempts for that UUID; an error from before fails the publish without recording the
// message. after runs once the message is recorded; an error from it fails the publish all the
// same, as a broker whose confirmation is lost.
type recorder struct {
	before func(msg *message.Message, attempt int) error
	after  func(msg *message.Message, attempt int) error

	mu       sync.Mutex
	sent     []sent
	attempts map[string]int
	changed  chan struct{}
}

var _ message.Publisher = (*recorder)(nil)

func newRecorder() *recorder {
	return &recorder{attempts: map[string]int{}, changed: make(chan struct{})}
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		r.mu.Lock()
		attempt := r.attempts[m.UUID]
		r.attempts[m.UUID]++
		r.mu.Unlock()
		if r.before != nil {
			if err := r.before(m, attempt); err != nil {
				return err
			}
		}
		r.mu.Lock()
		r.sent = append(r.sent, sent{topic: topic, msg: m, at: time.Now()})
		close(r.changed)
		r.changed = make(chan struct{})
		r.mu.Unlock()
		if r.after != nil {
			if err := r.after(m, attempt); err != nil {
				return err
			}
		}
	}
	return nil
}

func (r *recorder) Close() error { return nil }

// all returns what was recorded so far.
func (r *recorder) all() []sent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]sent(nil), r.sent...)
}

// ids returns the UUIDs recorded so far, in order.
func (r *recorder) ids() []string {
	var ids []string
	for _, s := range r.all() {
		ids = append(ids, s.msg.UUID)
	}
	return ids
}

// waitFor waits until at least n messages are recorded and returns them all.
func (r *recorder) waitFor(t *testing.T, n int) []sent {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		r.mu.Lock()
		got, changed := len(r.sent), r.changed
		r.mu.Unlock()
		if got >= n {
			return r.all()
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("after %s: %d messages sent, want %d", waitTimeout, got, n)
		}
	}
}
