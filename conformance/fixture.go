package conformance

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// waitFor bounds every wait of the suite for something the broker and the routers do. It is
// generous: a PostgreSQL queue delivers a message only once every older transaction on the
// server has ended, those of other tests included.
const waitFor = 60 * time.Second

// effectsTable is the business table of the scenarios: one row per applied effect,
// deliberately without a unique key, so that a duplicate effect shows as a second row.
const effectsTable = "conformance_effects"

// fixture is one test's broker, database and topics.
type fixture struct {
	t        *testing.T
	features Features
	mode     Mode
	// edit is the setup's edit of every handler's chain (Setup.Chain); nil for none.
	edit      func(onceflow.Chain) onceflow.Chain
	timings   Timings
	brokerURL string
	dbURL     string
	db        *sqldb.DB
	logger    *slog.Logger
	// prefix starts every topic and message id of the test.
	prefix string
	// dlq is the dead-letter topic of the test's routers.
	dlq string

	mu     sync.Mutex
	topics []string // used on the broker; removed from a shared server when the test ends

	// poisonAgain counts the dead letters that the Poison scenario's phases allowed beyond one
	// per poison message (a consumer killed between a dead letter and its record).
	poisonAgain int
}

func newFixture(t *testing.T, s Setup, features Features, mode Mode) *fixture {
	t.Helper()
	f := &fixture{
		t:        t,
		features: features,
		mode:     mode,
		edit:     s.Chain,
		timings:  s.Timings.withDefaults(),
		prefix:   testsvc.UniqueName("cf"),
	}
	f.logger = slog.New(slog.NewTextHandler(newTestWriter(t), &slog.HandlerOptions{Level: slog.LevelWarn}))
	f.brokerURL = s.BrokerURL(t)
	// Registered before the brokers and routers, so it runs after they have closed.
	t.Cleanup(func() { testsvc.RemoveTopics(t, f.brokerURL, []string{broker.DefaultConsumerGroup}, f.usedTopics()...) })
	f.dlq = f.topic("dlq")

	dbURL := s.DatabaseURL(t)
	var db *sqldb.DB
	err := retryConnect(func() (err error) {
		db, err = sqldb.Open(context.Background(), dbURL)
		return err
	})
	require.NoError(t, err, "open the application database %s", sqldb.Redact(dbURL))
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, warm(db, warmConns), "connect to the application database %s", sqldb.Redact(dbURL))
	f.db, f.dbURL = db, dbURL
	_, err = db.Exec(`CREATE TABLE ` + effectsTable + ` (handler VARCHAR(64) NOT NULL, message_id VARCHAR(255) NOT NULL, note VARCHAR(255) NOT NULL)`)
	require.NoError(t, err)
	return f
}

// topic returns the test's topic called name, and remembers it for the cleanup.
func (f *fixture) topic(name string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	tp := f.prefix + "_" + name
	f.topics = append(f.topics, tp)
	return tp
}

func (f *fixture) usedTopics() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.topics...)
}

// id returns the test's message id called name. Ids fit the SQL queues' 36-byte UUID column.
func (f *fixture) id(name string) string { return f.prefix[len(f.prefix)-8:] + "-" + name }

// openBroker opens a Broker on rawURL with the suite's timings, closed when the test ends.
// Each Broker is a connection of its own, as another process would have.
func (f *fixture) openBroker(rawURL string) *broker.Broker {
	f.t.Helper()
	var wl *slog.Logger
	if os.Getenv("ONCEFLOW_CONFORMANCE_DEBUG") != "" {
		wl = slog.New(slog.NewTextHandler(newTestWriter(f.t), &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	var b *broker.Broker
	err := retryConnect(func() (err error) {
		b, err = broker.Open(context.Background(), rawURL, broker.Options{
			Logger:       wl,
			NackDelay:    f.timings.NackDelay,
			AckTimeout:   f.timings.AckTimeout,
			PollInterval: f.timings.PollInterval,
		})
		return err
	})
	require.NoError(f.t, err)
	f.t.Cleanup(func() {
		if err := b.Close(); err != nil {
			f.t.Logf("close broker: %v", err)
		}
	})
	return b
}

// connectPatience is how long the suite retries opening a connection that the server refuses
// (PostgreSQL's "too many clients", which other tests sharing the server cause for a moment).
const connectPatience = 30 * time.Second

// retryConnect runs open until it succeeds, fails otherwise than by a refused or lost
// connection, or connectPatience passes.
// warmConns is how many connections of the application database a router of the suite's
// scenarios holds before they begin.
const warmConns = 8

// warm opens n connections of db and leaves them idle in its pool, so that a scenario's
// transactions do not connect. While the suite runs, a PostgreSQL connect has taken 1.5 s on a
// 2-core machine, most of a scenario's ack timeout: a first delivery that had to connect could
// time out and be delivered again, which the scenarios' exact counts do not allow.
func warm(db *sqldb.DB, n int) error {
	ctx := context.Background()
	conns := make([]*sql.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range n {
		c, err := db.Conn(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	return nil
}

func retryConnect(open func() error) error {
	deadline := time.Now().Add(connectPatience)
	for {
		err := open()
		if err == nil || sqldb.Classify(err) != sqldb.Connection || time.Now().After(deadline) {
			return err
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// handlerSpec is a handler of a scenario; the fixture fills in the rest.
type handlerSpec struct {
	// Name of the handler; it is part of the dedup key, so that two routers with a handler of
	// the same name deduplicate each other's messages.
	Name  string
	Topic string
	// Processor defaults to applying one effect under the handler's name.
	Processor processor.Processor
	// Batch is the processor in Batch mode. It defaults to one multi-row INSERT of the effects
	// when Processor is nil, and otherwise to Processor run for one message after the other,
	// the first that fails named with processor.ErrorFor.
	Batch processor.Batch
	// Outer are stages placed outside retry: an error they return goes to the router as it
	// is, and a retryable one is a nack.
	Outer []onceflow.Stage
	// Inner are stages placed between retry and the transaction.
	Inner []onceflow.Stage
	// MaxAttempts of the in-process retry. Defaults to 3.
	MaxAttempts int
	// Concurrency overrides the mode's number of subscriptions.
	Concurrency int
	// MaxDeliveries is the handler's delivery limit (Handler.DeadLetter.MaxDeliveries). Defaults to the
	// router's.
	MaxDeliveries int
	// Redelivery are the handler's redelivery delays. Defaults to the suite's nack delay,
	// whichever delivery failed.
	Redelivery []time.Duration
	// DB is the handler's database. Defaults to the fixture's.
	DB *sqldb.DB
	// Dedup is the handler's dedup mode. Defaults to middleware.DedupInsertFirst.
	Dedup middleware.DedupMode
}

// handler returns the onceflow handler for spec in the fixture's mode: the canonical
// ExactlyOnce chain (with group commit in GroupCommit mode, and a batch processor in Batch
// mode), edited by the setup's Chain, with the spec's stages inserted.
//
// It reads only the fixture's mode, features, timings and database: the Poison scenario's
// consumer processes build their handlers with it too.
func (f *fixture) handler(spec handlerSpec, sub message.Subscriber) onceflow.Handler {
	h := onceflow.Handler{
		Name:        spec.Name,
		Topic:       spec.Topic,
		Subscriber:  sub,
		DB:          f.db,
		Processor:   spec.Processor,
		Concurrency: spec.Concurrency,
		DeadLetter:  middleware.DeadLetter{MaxDeliveries: spec.MaxDeliveries},
		Retry:       middleware.Retry{MaxAttempts: spec.MaxAttempts, InitialInterval: 5 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
		// A failed message comes back after the suite's nack delay, whichever delivery it is.
		Redelivery: onceflow.RedeliveryConfig{Delays: []time.Duration{f.timings.NackDelay}},
		Dedup:      middleware.Dedup{Mode: spec.Dedup},
	}
	if spec.DB != nil {
		h.DB = spec.DB
	}
	if len(spec.Redelivery) > 0 {
		h.Redelivery.Delays = spec.Redelivery
	}
	if f.mode == Batch {
		h.Processor, h.BatchProcessor = nil, spec.Batch
		switch {
		case h.BatchProcessor != nil:
		case spec.Processor != nil:
			h.BatchProcessor = oneByOne(spec.Processor)
		default:
			h.BatchProcessor = applyEffects(spec.Name)
		}
	} else if h.Processor == nil {
		h.Processor = applyEffect(spec.Name)
	}
	if h.Concurrency == 0 {
		h.Concurrency = 2
		if f.mode != PerMessage && f.features.ConcurrentDelivery {
			// More subscriptions than two add nothing where the consumers of a group take
			// turns, but connections (an SQL queue's consumer holds one while it waits).
			h.Concurrency = 4
		}
	}
	chain := onceflow.ExactlyOnce.Chain()
	if f.edit != nil {
		chain = f.edit(chain)
	}
	if len(spec.Outer) > 0 {
		chain = chain.Before(onceflow.StageRetry, spec.Outer...)
	}
	if len(spec.Inner) > 0 {
		chain = chain.Before(onceflow.StageTransaction, spec.Inner...)
	}
	h.Chain = chain
	// Group commit is the default; per message, it is turned off where the chain has the
	// transaction stage that reads the setting.
	h.GroupCommit.Disabled = f.mode == PerMessage && slices.Contains(chain.Names(), onceflow.StageTransaction)
	return h
}

// node is one running router: what a consumer process is in production.
type node struct {
	router *onceflow.Router
	probe  *probe
	broker *broker.Broker
	// stop closes the router gracefully, as a process that shuts down does, and reports the
	// error of its Run. It is safe to call more than once.
	stop func() error
}

// startNode runs a router that consumes from b with the handlers of specs, until the test
// ends. register, if not nil, runs before the handlers are added (to register interceptors and
// migrations). The router's dead letters go to the fixture's dead-letter topic on b.
func (f *fixture) startNode(b *broker.Broker, register func(*onceflow.Router), specs ...handlerSpec) *node {
	f.t.Helper()
	return f.startNodeLogged(b, f.logger, register, specs...)
}

// startNodeLogged is startNode with the router's logger.
func (f *fixture) startNodeLogged(b *broker.Broker, logger *slog.Logger, register func(*onceflow.Router), specs ...handlerSpec) *node {
	f.t.Helper()
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(),
		DeadLetterTopic:     f.dlq,
		Logger:              logger,
		PurgeInterval:       -1,
		CloseTimeout:        5 * time.Second,
	})
	require.NoError(f.t, err)
	if register != nil {
		register(r)
	}
	p := newProbe(f.t)
	for _, spec := range specs {
		sub, err := b.Subscriber()
		require.NoError(f.t, err)
		require.NoError(f.t, r.AddHandler(f.handler(spec, p.wrap(spec.Name, sub))))
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		cancel()
		f.t.Fatalf("router stopped before running: %v", err)
	case <-time.After(waitFor):
		cancel()
		f.t.Fatal("router did not start")
	}
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				runErr = err
			}
		})
		return runErr
	}
	f.t.Cleanup(func() {
		if err := stop(); err != nil {
			f.t.Errorf("router: %v", err)
		}
	})
	return &node{router: r, probe: p, broker: b, stop: stop}
}

// publish publishes a message with id and payload to topic on b. Extra metadata comes in
// pairs of name and value.
func (f *fixture) publish(b *broker.Broker, topic, id, payload string, metadata ...string) {
	f.t.Helper()
	m := message.NewMessage(id, []byte(payload))
	for i := 0; i+1 < len(metadata); i += 2 {
		m.Metadata.Set(metadata[i], metadata[i+1])
	}
	require.NoError(f.t, b.Publisher().Publish(topic, m), "publish %s to %s", id, topic)
}

// publishCopy publishes another copy of the message id, as a producer that retries its
// publish does. On NATS it gets a Nats-Msg-Id of its own, or JetStream would drop it as a
// duplicate publish before any consumer sees it.
func (f *fixture) publishCopy(b *broker.Broker, topic, id, payload string, copyNo int) {
	f.t.Helper()
	f.publish(b, topic, id, payload, broker.HeaderNATSMsgID, fmt.Sprintf("%s#copy%d", id, copyNo))
}

// applyEffect is the scenarios' default processor: it writes one effect row for the handler
// in the message's transaction.
func applyEffect(handler string) processor.Processor {
	return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		return writeEffect(ctx, handler, msg)
	})
}

func writeEffect(ctx context.Context, handler string, msg *messagedata.MessageData) error {
	return writeEffects(ctx, handler, []*messagedata.MessageData{msg})
}

// applyEffects is the scenarios' default batch: one multi-row INSERT of an effect per message.
func applyEffects(handler string) processor.Batch {
	return processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
		return writeEffects(ctx, handler, msgs)
	})
}

// writeEffects writes one effect row per message in the context's transaction, with one
// statement.
func writeEffects(ctx context.Context, handler string, msgs []*messagedata.MessageData) error {
	tx, ok := processor.TxFromContext(ctx)
	if !ok {
		return errors.New("no transaction in the context")
	}
	var q strings.Builder
	q.WriteString(`INSERT INTO ` + effectsTable + ` (handler, message_id, note) VALUES `)
	args := make([]any, 0, 3*len(msgs))
	for i, msg := range msgs {
		if i > 0 {
			q.WriteString(", ")
		}
		q.WriteString("(?, ?, ?)")
		note := string(msg.Payload)
		if len(note) > 255 {
			note = note[:255]
		}
		args = append(args, handler, msg.ID, note)
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(q.String()), args...)
	return err
}

// oneByOne is the batch of a scenario processor that does more than write an effect: it runs p
// for each message in turn, and names the first message that fails, so that the batch runs
// again without it and its error alone decides its outcome.
func oneByOne(p processor.Processor) processor.Batch {
	return processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
		for _, msg := range msgs {
			if err := p.Process(ctx, msg); err != nil {
				return processor.ErrorFor(msg, err)
			}
		}
		return nil
	})
}

// effects returns the number of effects of message id by handler.
func (f *fixture) effects(handler, id string) int {
	f.t.Helper()
	var n int
	require.NoError(f.t, f.db.Get(&n, f.db.Rebind(`SELECT COUNT(*) FROM `+effectsTable+` WHERE handler = ? AND message_id = ?`), handler, id))
	return n
}

// effectCounts returns the number of effects of each message by handler.
func (f *fixture) effectCounts(handler string) map[string]int {
	return f.countsIn(effectsTable, handler)
}

// countsIn returns the number of rows of each message of handler in table, an effects table.
func (f *fixture) countsIn(table, handler string) map[string]int {
	f.t.Helper()
	rows, err := f.db.Query(f.db.Rebind(`SELECT message_id, COUNT(*) FROM `+table+` WHERE handler = ? GROUP BY message_id`), handler)
	require.NoError(f.t, err)
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		require.NoError(f.t, rows.Scan(&id, &n))
		out[id] = n
	}
	require.NoError(f.t, rows.Err())
	return out
}

// eventually polls cond until it holds, failing the test after waitFor.
func (f *fixture) eventually(cond func() bool, msg string, args ...any) {
	f.t.Helper()
	testsvc.Eventually(f.t, waitFor, cond, msg, args...)
}

// waitAcks waits until the router acked message id of handler at least n times; the caller
// then asserts the exact counts.
func (f *fixture) waitAcks(p *probe, handler, id string, n int) {
	f.t.Helper()
	f.eventually(func() bool { return p.get(handler, id).Acks >= n }, "message %q of handler %s was not acked %d times: %v",
		id, handler, n, lazy(func() any { return p.get(handler, id) }))
}
