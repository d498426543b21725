package verify

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// CrashPoint is a moment in the processing of a message at which a consumer kills itself with
// SIGKILL, to exercise one crash window of the guarantee model.
type CrashPoint string

// The crash points, in the order a message meets them.
const (
	// AfterReceive: the message was delivered, nothing was written. A BestEffort consumer has
	// acked it already.
	AfterReceive CrashPoint = "after-receive"
	// BeforeCommit: the effect was written in the transaction, which has not committed.
	BeforeCommit CrashPoint = "before-commit"
	// AfterCommit: the transaction committed, the message is not acked yet.
	AfterCommit CrashPoint = "after-commit"
)

// CrashPoints lists every crash point.
var CrashPoints = []CrashPoint{AfterReceive, BeforeCommit, AfterCommit}

// Crash arms a crash point: the consumer kills itself at Point while processing its Nth
// delivery.
type Crash struct {
	Point CrashPoint
	N     int
}

// String formats c as "point:n", the form ParseCrash reads.
func (c Crash) String() string { return fmt.Sprintf("%s:%d", c.Point, c.N) }

// ParseCrash reads "point:n".
func ParseCrash(s string) (Crash, error) {
	point, n, ok := strings.Cut(s, ":")
	count, err := strconv.Atoi(n)
	if !ok || err != nil || count < 1 {
		return Crash{}, fmt.Errorf("crash %q: want point:n with n >= 1", s)
	}
	for _, p := range CrashPoints {
		if string(p) == point {
			return Crash{Point: p, N: count}, nil
		}
	}
	return Crash{}, fmt.Errorf("crash %q: unknown point %q (want after-receive, before-commit or after-commit)", s, point)
}

// ConsumerConfig configures one consumer process.
type ConsumerConfig struct {
	BrokerURL   string
	DBURL       string
	Topic       string
	Handler     string
	Mode        onceflow.QoS
	GroupCommit bool
	// Batch processes the messages with a batch processor (it implies group commit).
	Batch bool
	// Dedup is how the handler detects duplicates, when Mode is ExactlyOnce.
	Dedup Dedup
	// DeadLetterTopic is the topic of the dead letters.
	DeadLetterTopic string
	// MaxDeliveries is the handler's delivery limit.
	MaxDeliveries int
	RunID         string
	Consumer      int
	Concurrency   int
	Crash         *Crash
	// Ready receives the line "ready" once the consumer is subscribed, then every 100 ms a
	// line "delivered N" with the number of deliveries received so far, and the line
	// "poison-kill" when the crash-loop message is about to kill the process.
	Ready io.Writer
	// Logger receives the consumer's logs.
	Logger *slog.Logger
}

// effectsTable is the business table of a verification run: one row per applied effect,
// without a unique key, so that a duplicate effect is a second row.
const effectsTable = "onceflow_verify_effects"

// appliedTable records, in ExactlyOnceInOrder mode, each applied message's key and sequence in
// the order of application.
const appliedTable = "onceflow_verify_applied"

// poisonKillLine is what a consumer writes just before the crash-loop message kills it.
const poisonKillLine = "poison-kill"

// redeliveryDelays are the consumers' redelivery delays: short, so that a message that fails
// every time reaches the delivery limit within the run.
var redeliveryDelays = []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond}

// Consume runs one consumer until ctx ends. It applies one effect per message to the effects
// table, in the chain of the configured quality of service, with the crash point armed if any.
func Consume(ctx context.Context, cfg ConsumerConfig) error {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	db, err := sqldb.Open(ctx, cfg.DBURL)
	if err != nil {
		return err
	}
	defer db.Close()
	b, err := broker.Open(ctx, cfg.BrokerURL, brokerOptions())
	if err != nil {
		return err
	}
	defer b.Close()
	sub, err := b.Subscriber()
	if err != nil {
		return err
	}

	router, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(),
		DeadLetterTopic:     cfg.DeadLetterTopic,
		Logger:              cfg.Logger,
		PurgeInterval:       -1,
		SkipMigrate:         true,
		CloseTimeout:        5 * time.Second,
	})
	if err != nil {
		return err
	}
	crash := crashStages(cfg.Crash)
	var out sync.Mutex
	line := func(s string) {
		out.Lock()
		defer out.Unlock()
		if cfg.Ready != nil {
			fmt.Fprintln(cfg.Ready, s)
		}
	}
	insert := `INSERT INTO ` + effectsTable + ` (run_id, message_id, consumer) VALUES (?, ?, ?)`
	inOrder := cfg.Mode == onceflow.ExactlyOnceInOrder
	// apply writes the effects of msgs, each in the run its payload names; a message that names
	// none violates NOT NULL. A message that says so panics, or kills the process.
	apply := func(ctx context.Context, msgs []*messagedata.MessageData, vs []poisonPayload) error {
		for _, v := range vs {
			if v.Crash {
				line(poisonKillLine)
				die()
			}
			if v.Panic {
				panic(poisonPanicValue)
			}
		}
		tx, ok := processor.TxFromContext(ctx)
		if !ok {
			return errors.New("no transaction")
		}
		q, args := insert, make([]any, 0, 3*len(msgs))
		for i, msg := range msgs {
			if i > 0 {
				q += ", (?, ?, ?)"
			}
			args = append(args, vs[i].Run, msg.ID, cfg.Consumer)
		}
		if _, err := tx.ExecContext(ctx, db.Rebind(q), args...); err != nil {
			return err
		}
		if inOrder {
			// The application order of each key, for counting order violations.
			for _, msg := range msgs {
				if err := ordercheck.Record(ctx, tx, appliedTable, cfg.RunID, msg.Key, msg.Sequence, msg.ID, cfg.Consumer); err != nil {
					return err
				}
			}
		}
		return nil
	}
	h := onceflow.Handler{
		Name:        cfg.Handler,
		Topic:       cfg.Topic,
		Subscriber:  sub,
		DB:          db,
		Chain:       crash.chain(cfg.Mode, cfg.Batch),
		Concurrency: max(cfg.Concurrency, 1),
		GroupCommit: onceflow.GroupCommitConfig{Enabled: cfg.GroupCommit},
	}
	if cfg.Mode != onceflow.BestEffort {
		h.DeadLetter.MaxDeliveries = cfg.MaxDeliveries
		h.Redelivery = onceflow.RedeliveryConfig{Delays: redeliveryDelays}
		h.Retry = middleware.Retry{MaxAttempts: 5, InitialInterval: 20 * time.Millisecond, MaxInterval: time.Second}
	}
	switch cfg.Dedup {
	case DedupByOffset:
		h.Dedup.Mode = middleware.DedupByOffset
	case DedupAckInTx:
		h.Dedup.Mode = middleware.DedupAckInTransaction
	}
	if cfg.Batch {
		h.BatchProcessor = processor.JSONBatch(func(ctx context.Context, msgs []*messagedata.MessageData, vs []poisonPayload) error {
			if err := apply(ctx, msgs, vs); err != nil {
				return err
			}
			crash.beforeCommit(len(msgs))
			return nil
		})
	} else {
		h.Processor = processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, v poisonPayload) error {
			return apply(ctx, []*messagedata.MessageData{msg}, []poisonPayload{v})
		})
	}
	if err := router.AddHandler(h); err != nil {
		return err
	}

	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
		line("ready")
	case err := <-done:
		return fmt.Errorf("consumer stopped before subscribing: %w", err)
	}
	// Report the deliveries seen so far, so that verify can place its faults by progress even
	// when effects are lost.
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			return err
		case <-tick.C:
			line(fmt.Sprintf("delivered %d", delivered.Load()))
		}
	}
}

// crashPoints are the stages of a consumer's crash points; the armed one kills the process at
// its Nth delivery. After-receive and after-commit are observers, outermost, which leave a
// handler with group commit the lane it has without them: after-receive runs before the chain
// (it also counts the deliveries), after-commit once the chain has returned, after the commit
// and before the ack. Before-commit runs innermost, in the transaction; with a batch
// processor, which nothing may stand after the transaction of, the batch processor itself
// calls beforeCommit with the number of messages it wrote.
type crashPoints struct {
	afterReceive, afterCommit onceflow.Stage
	beforeCommitStage         onceflow.Stage
	beforeCommit              func(n int)
}

// crashStages returns the crash points of a consumer, of which armed (nil for none) kills it.
func crashStages(armed *Crash) crashPoints {
	var deliveries atomic.Int64
	reached := func(point CrashPoint, n int64) bool {
		if armed == nil || armed.Point != point {
			return false
		}
		k := deliveries.Add(n)
		return k >= int64(armed.N) && k-n < int64(armed.N)
	}
	c := crashPoints{beforeCommit: func(n int) {
		if reached(BeforeCommit, int64(n)) {
			die()
		}
	}}
	c.afterReceive = onceflow.UseObserver(onceflow.StageName(AfterReceive), crashObserver{begin: func() {
		delivered.Add(1)
		if reached(AfterReceive, 1) {
			// A consumer that dies on receipt has usually started working: give an
			// acknowledgement sent on receipt the time to leave.
			time.Sleep(20 * time.Millisecond)
			die()
		}
	}})
	c.afterCommit = onceflow.UseObserver(onceflow.StageName(AfterCommit), crashObserver{end: func() {
		if reached(AfterCommit, 1) {
			die()
		}
	}})
	c.beforeCommitStage = onceflow.Use(onceflow.StageName(BeforeCommit), func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			c.beforeCommit(1)
			return err
		})
	})
	return c
}

// chain returns the canonical chain of mode with the crash points in place: before-commit
// innermost, unless a batch processor holds it.
func (c crashPoints) chain(mode onceflow.QoS, batch bool) onceflow.Chain {
	chain := mode.Chain().Before(onceflow.StageTracing, c.afterReceive, c.afterCommit)
	if batch {
		return chain
	}
	names := chain.Names()
	return chain.After(names[len(names)-1], c.beforeCommitStage)
}

// delivered counts the deliveries this consumer received.
var delivered atomic.Int64

// crashObserver runs begin before a delivery's chain and end after it; either may be nil.
type crashObserver struct{ begin, end func() }

func (o crashObserver) Begin(ctx context.Context, _ *messagedata.MessageData) context.Context {
	if o.begin != nil {
		o.begin()
	}
	return ctx
}

func (o crashObserver) End(context.Context, *messagedata.MessageData, error) {
	if o.end != nil {
		o.end()
	}
}

// die ends the process the way a power cut or the OOM killer does: no deferred function, no
// graceful close.
func die() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// brokerOptions are the broker settings of a verification run, the same for every broker: its
// default prefetch, and an ack timeout short enough for the messages of a killed consumer to
// come back within the run.
func brokerOptions() broker.Options {
	return broker.Options{ConsumerGroup: "onceflow_verify", AckTimeout: 5 * time.Second}
}
