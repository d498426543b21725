package conformance

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/sqldb"
)

// This file is the consumer process of the Poison scenario: a child of the test binary that
// runs one handler, reports each delivery and settlement on standard output, and that the
// crash-loop message kills with SIGKILL (pool.go starts and supervises them).

// consumerEnv names the environment variable that makes the test binary a consumer process of
// the Poison scenario; its value is the consumer's consumerSpec, in JSON.
const consumerEnv = "ONCEFLOW_CONFORMANCE_CONSUMER"

// consumerMainCalled records that the test binary's TestMain calls ConsumerMain, so that the
// suite may start it as a consumer process.
var consumerMainCalled atomic.Bool

// ConsumerMain makes the test binary a consumer process of the Poison scenario when the suite
// started it as one: it runs the consumer until the suite kills it or closes its standard
// input, and exits. Otherwise it returns at once. Call it first in the TestMain of a package
// that runs the suite:
//
//	func TestMain(m *testing.M) {
//		conformance.ConsumerMain()
//		os.Exit(m.Run())
//	}
//
// Without it the Poison scenario runs its consumers as routers in the test process and, for
// the message that kills its consumer, closes one abruptly instead of killing a process.
func ConsumerMain() {
	consumerMainCalled.Store(true)
	raw, ok := os.LookupEnv(consumerEnv)
	if !ok {
		return
	}
	if err := runConsumer(raw); err != nil {
		fmt.Fprintln(os.Stderr, "conformance consumer:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// consumerSpec is what a consumer process of the Poison scenario runs.
type consumerSpec struct {
	BrokerURL       string  `json:"broker_url"`
	DatabaseURL     string  `json:"database_url"`
	Mode            Mode    `json:"mode"`
	Timings         Timings `json:"timings"`
	DeadLetterTopic string  `json:"dead_letter_topic"`
	Handler         string  `json:"handler"`
	Topic           string  `json:"topic"`
}

// runConsumer is the consumer process: the handler of spec on a router of its own. It writes
// "ready" on standard output once subscribed, then a line per delivery ("d <count> <id>", with
// the broker's delivery count, before the router gets it) and per settlement ("a 0 <id>" for an
// ack, "n 0 <id>" for a nack, then "l 0 <id>" when the router found the delivery ended before
// its ack), and kills itself with SIGKILL when the crash-loop message reaches
// its processor.
func runConsumer(raw string) error {
	var spec consumerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return fmt.Errorf("%s: %w", consumerEnv, err)
	}
	ctx := context.Background()
	var db *sqldb.DB
	err := retryConnect(func() (err error) {
		db, err = sqldb.Open(ctx, spec.DatabaseURL)
		return err
	})
	if err != nil {
		return err
	}
	db.SetMaxOpenConns(3)
	if err := warm(db, 3); err != nil {
		return err
	}
	var b *broker.Broker
	err = retryConnect(func() (err error) {
		b, err = broker.Open(ctx, spec.BrokerURL, brokerOptions(spec.Timings))
		return err
	})
	if err != nil {
		return err
	}
	sub, err := b.Subscriber()
	if err != nil {
		return err
	}
	out := &eventWriter{w: os.Stdout}
	logger := slog.New(ackLostReporter{
		Handler: slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}),
		report:  func(id string) { out.event('l', 0, id) },
	})
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(),
		DeadLetterTopic:     spec.DeadLetterTopic,
		Logger:              logger,
		PurgeInterval:       -1,
		SkipMigrate:         true, // the suite created the tables
		CloseTimeout:        5 * time.Second,
	})
	if err != nil {
		return err
	}
	// The handler is built as the suite builds its own, from the mode and timings.
	f := &fixture{mode: spec.Mode, timings: spec.Timings, db: db}
	h := f.handler(poisonSpec(spec.Handler, spec.Topic, func(context.Context) { die() }), &reportingSubscriber{Subscriber: sub, report: out.event})
	if err := r.AddHandler(h); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		return fmt.Errorf("router stopped before running: %w", err)
	}
	out.line("ready")
	// Until the suite closes standard input, or dies.
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// die ends the process the way the OOM killer does: SIGKILL, no deferred function, no close.
func die() {
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Kill()
	}
	select {}
}

// eventWriter writes a consumer process's events to standard output, a line each.
type eventWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (e *eventWriter) line(s string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	_, _ = io.WriteString(e.w, s+"\n")
}

func (e *eventWriter) event(kind byte, count int, id string) {
	e.line(string(kind) + " " + strconv.Itoa(count) + " " + strconv.Quote(id))
}

// reportingSubscriber reports each delivery of its subscriptions, with the broker's delivery
// count (0 when it counts none), before passing the delivery on, and whether the router acked or
// nacked it.
type reportingSubscriber struct {
	message.Subscriber
	report func(kind byte, count int, id string)
	// stop ends the watches of deliveries never settled; nil in a consumer process, which
	// dies with them.
	stop <-chan struct{}
}

func (s *reportingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for m := range in {
			id := messageID(m)
			info, _ := redelivery.FromContext(m.Context())
			s.report('d', info.Count, id)
			go func() {
				select {
				case <-m.Acked():
					s.report('a', 0, id)
				case <-m.Nacked():
					s.report('n', 0, id)
				case <-s.stop:
				}
			}()
			select {
			case out <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// brokerOptions are the broker options of the suite's timings.
func brokerOptions(tm Timings) broker.Options {
	return broker.Options{NackDelay: tm.NackDelay, AckTimeout: tm.AckTimeout, PollInterval: tm.PollInterval}
}

// migrateRouterTables creates the dedup and delivery-count tables in the fixture's database, so
// that the Poison scenario's consumers need not each try.
func (f *fixture) migrateRouterTables() {
	f.t.Helper()
	ctx := context.Background()
	store, err := dedup.New(f.db, dedup.Config{})
	require.NoError(f.t, err)
	require.NoError(f.t, store.Migrate(ctx))
	counter, err := dedup.NewCounter(f.db, dedup.CounterConfig{})
	require.NoError(f.t, err)
	require.NoError(f.t, counter.Migrate(ctx))
}
