package onceflowtest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/crashpoint"
	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// This file is the consumer process of a run: it runs the handler under test with the faults
// of its spec, and tells the run what happens through its control pipe.

// envSpec is the environment variable that makes a process a consumer of a run: it holds the
// consumer's spec, as JSON.
const envSpec = "ONCEFLOWTEST_CONSUMER"

// controlFD is the file descriptor of a consumer's control pipe (os/exec's ExtraFiles[0]).
const controlFD = 3

// spec is what a consumer process gets from its run.
type spec struct {
	// Test is the test whose Prove the process serves, and Call the number of that call of
	// Prove in the test, from 1; empty under Run.
	Test            string `json:"test,omitempty"`
	Call            int    `json:"call,omitempty"`
	Topic           string `json:"topic"`
	Broker          string `json:"broker"`
	DB              string `json:"db"`
	DeadLetterTopic string `json:"dead_letter_topic"`
	Consumer        int    `json:"consumer"`
	// Crash is the crash point the process dies at, at its N-th passage; nil for none.
	Crash *crash `json:"crash,omitempty"`
	// Faults is the file of the faults to inject, by message id (a JSON object).
	Faults string `json:"faults"`
	// Run is the run's id; Order asks the process to record the order in which the handler's
	// transactions apply the messages (ExactlyOnceInOrder).
	Run   string `json:"run"`
	Order bool   `json:"order,omitempty"`
}

// crash arms a crash point: the process dies at its N-th passage at Point.
type crash struct {
	Point CrashPoint `json:"point"`
	N     int        `json:"n"`
}

func (c crash) String() string { return fmt.Sprintf("%s:%d", c.Point, c.N) }

// fault is what a consumer does to a message.
type fault string

const (
	faultFailOnce    fault = "fail-once"
	faultPanicOnce   fault = "panic-once"
	faultFailAlways  fault = "fail-always"
	faultPanicAlways fault = "panic-always"
	faultCrashAlways fault = "crash-always"
	faultLongID      fault = "long-id" // nothing at run time: its id is the fault
)

// errInjected is the retryable failure a consumer injects after the processor has written.
var errInjected = errors.New("onceflowtest: failure injected after the processor returned (the transaction must roll back what it wrote)")

// injectedPanic is what a consumer panics with after the processor has written.
const injectedPanic = "onceflowtest: panic injected after the processor returned (the transaction must roll back what it wrote)"

// appliedTable records, for a handler of ExactlyOnceInOrder, each applied message's key and
// sequence in the order of application, in the handler's transaction.
const appliedTable = "onceflowtest_applied"

// The control lines a consumer writes, one per event.
const (
	lineReady      = "ready"
	lineReceived   = "recv"        // recv <id>
	lineAcked      = "ack"         // ack <id>: its outcome acknowledges it, the ack is about to go
	lineInjected   = "fault"       // fault <kind> <id>
	lineCrash      = "crash"       // crash <point> <id>
	linePoisonKill = "poison-kill" // poison-kill <id>
)

// IsConsumer reports whether this process is a consumer process that a run started: a program
// that serves both as itself and as a run's consumer (Config.Command) calls Consume when it is.
func IsConsumer() bool { return os.Getenv(envSpec) != "" }

// Consume runs this process as a consumer of the run that started it, with the handler that
// handler builds, until ctx ends or the run stops it (SIGTERM); the run may also kill it at any
// moment. The program that Config.Command runs calls it with the Config's Handler; under Prove
// the test binary does, and no program needs to. It fails when the process is not a run's
// consumer (IsConsumer).
func Consume(ctx context.Context, handler func(Env) onceflow.Handler) error {
	s, err := readSpec()
	if err != nil {
		return err
	}
	return serve(ctx, s, handler)
}

func readSpec() (spec, error) {
	var s spec
	raw := os.Getenv(envSpec)
	if raw == "" {
		return s, fmt.Errorf("onceflowtest: not a consumer process of a run ($%s is not set)", envSpec)
	}
	if err := json.Unmarshal([]byte(raw), &s); err != nil {
		return s, fmt.Errorf("onceflowtest: $%s: %w", envSpec, err)
	}
	return s, nil
}

// serve runs the consumer of s.
func serve(ctx context.Context, s spec, build func(Env) onceflow.Handler) error {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctl := &control{w: os.NewFile(controlFD, "onceflowtest-control")}
	// The run holds the other end of stdin: when it dies, the consumer follows at once.
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		die()
	}()
	faults, err := readFaults(s.Faults)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	db, err := sqldb.Open(ctx, s.DB)
	if err != nil {
		return err
	}
	defer db.Close()
	b, err := broker.Open(ctx, s.Broker, brokerOptions())
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
		DeadLetterTopic:     s.DeadLetterTopic,
		Logger:              logger,
		PurgeInterval:       -1,
		SkipMigrate:         true, // the run migrated, once
		CloseTimeout:        5 * time.Second,
	})
	if err != nil {
		return err
	}
	h := build(Env{Subscriber: sub, Publisher: b.Publisher(), DB: db, Consumer: s.Consumer})
	h.Topic = s.Topic
	inj := &injector{faults: faults, ctl: ctl}
	if s.Order {
		inj.order = func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, ok := processor.TxFromContext(ctx)
			if !ok {
				return errors.New("onceflowtest: no transaction to record the order of application in")
			}
			return ordercheck.Record(ctx, tx, appliedTable, s.Run, msg.Key, msg.Sequence, msg.ID, s.Consumer)
		}
	}
	inj.wrap(&h)
	hook := &crashHook{ctl: ctl, armed: s.Crash}
	crashpoint.Set(hook.reach)
	defer crashpoint.Set(nil)
	if err := router.AddHandler(h); err != nil {
		return err
	}

	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
		ctl.send(lineReady, "")
	case err := <-done:
		return fmt.Errorf("the consumer stopped before subscribing: %w", err)
	}
	err = <-done
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

func readFaults(path string) (map[string]fault, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("onceflowtest: read the faults: %w", err)
	}
	var faults map[string]fault
	if err := json.Unmarshal(b, &faults); err != nil {
		return nil, fmt.Errorf("onceflowtest: read the faults: %w", err)
	}
	return faults, nil
}

// redeliveryDelays are the redelivery delays of a handler that sets none: short, so that a
// message that fails every time reaches the delivery limit within the run. They change when a
// message comes back, not whether.
var redeliveryDelays = []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond}

// brokerOptions are the broker settings of a run, in the run's process and in its consumers:
// an ack timeout short enough for the messages of a killed consumer to come back within the
// run (the SQL and SQLite queues, NATS, Redis; RabbitMQ gives them back when the connection
// drops).
func brokerOptions() broker.Options {
	return broker.Options{ConsumerGroup: "onceflowtest", AckTimeout: 5 * time.Second}
}

// control is a consumer's end of its control pipe: one line per event, each written whole with
// one write, so that the run reads every line written before a SIGKILL.
type control struct {
	mu sync.Mutex
	w  io.Writer
}

func (c *control) send(what, arg string) {
	line := what
	if arg != "" {
		line += " " + strconv.Quote(arg)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, err := io.WriteString(c.w, line+"\n"); err != nil && !errors.Is(err, os.ErrClosed) {
		die() // the run is gone
	}
}

// crashHook is a consumer's crashpoint.Hook: it reports each delivery, and kills the process at
// its armed crash point.
type crashHook struct {
	ctl     *control
	armed   *crash
	reached atomic.Int64
}

func (h *crashHook) reach(p crashpoint.Point, id string) {
	switch p {
	case crashpoint.Received:
		h.ctl.send(lineReceived, id)
	case crashpoint.AfterCommit:
		h.ctl.send(lineAcked, id)
	}
	if h.armed == nil || pointOf(p) != h.armed.Point || h.reached.Add(1) != int64(h.armed.N) {
		return
	}
	h.ctl.send(lineCrash+" "+string(h.armed.Point), id)
	if p == crashpoint.Received {
		// A consumer that dies on receipt has usually started working: give an
		// acknowledgement sent on receipt (BestEffort) the time to leave.
		time.Sleep(20 * time.Millisecond)
	}
	die()
}

// pointOf returns the crash point of p.
func pointOf(p crashpoint.Point) CrashPoint {
	switch p {
	case crashpoint.Received:
		return AfterReceive
	case crashpoint.BeforeCommit:
		return BeforeCommit
	case crashpoint.AfterCommit:
		return AfterCommit
	case crashpoint.DeadLettered:
		return DeadLetterPublish
	}
	return ""
}

// injector injects the faults of a run into the handler's processor: after the processor (or
// the batch processor) has returned without error, inside the transaction, so that what it
// wrote must be rolled back.
type injector struct {
	faults map[string]fault
	ctl    *control
	// injected are the messages this process injected a fault of theirs into, which it
	// injects once.
	injected sync.Map
	// order records a message's application, for ExactlyOnceInOrder; nil otherwise.
	order func(ctx context.Context, msg *messagedata.MessageData) error
}

// wrap puts the injector around h's processor, and gives h short redelivery delays when it
// sets none.
func (inj *injector) wrap(h *onceflow.Handler) {
	q := h.Chain.QoS()
	if q == 0 {
		q = h.QoS
	}
	if len(h.Redelivery.Delays) == 0 && q != onceflow.BestEffort {
		h.Redelivery.Delays = redeliveryDelays
	}
	if p := h.Processor; p != nil {
		h.Processor = processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			inj.before(msg)
			if err := p.Process(ctx, msg); err != nil {
				return err
			}
			if err := inj.after(msg); err != nil {
				return err
			}
			if inj.order != nil {
				return inj.order(ctx, msg)
			}
			return nil
		})
	}
	if bp := h.BatchProcessor; bp != nil {
		h.BatchProcessor = processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			for _, msg := range msgs {
				inj.before(msg)
			}
			if err := bp.ProcessBatch(ctx, msgs); err != nil {
				return err
			}
			var errs []error
			for _, msg := range msgs {
				errs = append(errs, processor.ErrorFor(msg, inj.after(msg)))
			}
			return errors.Join(errs...)
		})
	}
}

// before kills the process for a crash-loop message.
func (inj *injector) before(msg *messagedata.MessageData) {
	if inj.faults[msg.ID] == faultCrashAlways {
		inj.ctl.send(linePoisonKill, msg.ID)
		die()
	}
}

// after returns the failure to inject into msg, or panics, after its processor returned nil.
// A fault that comes once comes at the message's first delivery, the first time its processor
// returns nil: an attempt whose transaction could not begin (its database connection was cut)
// does not use it up, and a redelivery (its consumer died meanwhile) does not see it again.
func (inj *injector) after(msg *messagedata.MessageData) error {
	f := inj.faults[msg.ID]
	if f == faultFailOnce || f == faultPanicOnce {
		if msg.Delivery > 1 {
			return nil
		}
		if _, done := inj.injected.LoadOrStore(msg.ID, true); done {
			return nil
		}
	}
	switch f {
	case faultFailOnce:
		inj.ctl.send(lineInjected+" failure", msg.ID)
		return errInjected
	case faultPanicOnce:
		inj.ctl.send(lineInjected+" panic", msg.ID)
		panic(injectedPanic)
	case faultFailAlways:
		return errInjected
	case faultPanicAlways:
		panic(injectedPanic)
	}
	return nil
}

// die ends the process the way a power cut or the OOM killer does: no deferred function, no
// graceful close.
func die() {
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Kill()
	}
	select {}
}

// parseLine splits a control line into its event, its kind (for fault and crash lines) and the
// message id.
func parseLine(line string) (event, kind, id string, ok bool) {
	event, rest, _ := strings.Cut(line, " ")
	if event == lineInjected || event == lineCrash {
		kind, rest, _ = strings.Cut(rest, " ")
	}
	if rest == "" {
		return event, kind, "", true
	}
	id, err := strconv.Unquote(rest)
	return event, kind, id, err == nil
}

// lines reads the control lines of r, calling fn for each, until r ends.
func lines(r io.Reader, fn func(string)) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), 1<<20)
	for sc.Scan() {
		fn(sc.Text())
	}
}
