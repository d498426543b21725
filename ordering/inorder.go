package ordering

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// GapPolicy says what the sweeper does with a key whose next message has not been applied for
// Config.GapTimeout: it never arrived (a gap), or it is parked but keeps failing. Whatever the
// policy, the timeout is logged and counted in onceflow.order.gap_timeouts.
type GapPolicy int

// The gap policies. The zero value is Wait.
const (
	// Wait keeps waiting for the missing message, and retrying a failing one: the key's later
	// messages stay parked until it is applied. Nothing is given up; an operator resolves the
	// gap (republishes the missing message, replays it from the dead-letter topic, fixes what
	// makes it fail). The default.
	Wait GapPolicy = iota
	// Skip gives up on the missing sequences: it records them as skipped, advances the key past
	// them and applies the parked messages that follow. A failing parked message is
	// dead-lettered and skipped likewise. A skipped sequence that arrives later is
	// dead-lettered, never applied out of order.
	Skip
	// DeadLetter publishes the key's parked messages to the dead-letter topic, with the reason
	// "gap at seq N not filled after T", and deletes them. The key stays where it is: once the
	// missing message arrives it is applied, and the dead-lettered ones can be replayed after
	// it (their duplicate-detection records are deleted with them, see Config.Forget).
	DeadLetter
)

var policyNames = map[GapPolicy]string{Wait: "wait", Skip: "skip", DeadLetter: "dead-letter"}

// String returns "wait", "skip" or "dead-letter".
func (p GapPolicy) String() string {
	if s, ok := policyNames[p]; ok {
		return s
	}
	return fmt.Sprintf("GapPolicy(%d)", int(p))
}

// ParseGapPolicy returns the policy named s ("wait", "skip", "dead-letter"; case, '-' and '_'
// ignored).
func ParseGapPolicy(s string) (GapPolicy, error) {
	norm := strings.ToLower(strings.NewReplacer("-", "", "_", "").Replace(s))
	for p, name := range policyNames {
		if strings.ReplaceAll(name, "-", "") == norm {
			return p, nil
		}
	}
	return 0, fmt.Errorf("unknown gap policy %q (want wait, skip or dead-letter)", s)
}

// Defaults of Config.
const (
	// DefaultGapTimeout is how long a key waits for its next message before its gap policy
	// applies, when Config.GapTimeout is zero.
	DefaultGapTimeout = 5 * time.Minute
	// DefaultSweepInterval is how often Run sweeps, when Config.SweepInterval is zero.
	DefaultSweepInterval = 10 * time.Second
	// DefaultMaxDrain is how many parked messages one transaction releases at most, when
	// Config.MaxDrain is zero.
	DefaultMaxDrain = 1000
)

// drainChunk is how many parked messages a drain reads at a time.
const drainChunk = 100

// drainSavepoint is the savepoint a drain sets before it applies parked messages, so that a
// failing one is rolled back alone. Its name differs from group commit's member savepoint.
const drainSavepoint = "onceflow_order_drain"

// Errors of the in-order interceptor. Each reaches the router wrapped in a permanent error:
// the message is dead-lettered with the reason.
var (
	// ErrUnordered reports a message that lacks an ordering key or a sequence number in a
	// handler that requires both.
	ErrUnordered = errors.New("message has no ordering key and sequence")
	// ErrSkipped reports a message whose sequence a gap policy gave up on before it arrived:
	// applying it now would apply it out of order.
	ErrSkipped = errors.New("sequence was skipped")
)

// Config configures the in-order interceptor of one handler.
type Config struct {
	// Handler is the name of the handler, part of every key of the store. Required; at most
	// MaxHandlerLen characters.
	Handler string

	// GapTimeout is how long a key may wait for its next message (or retry a parked one that
	// fails) before GapPolicy applies. Defaults to DefaultGapTimeout. It should exceed the
	// longest time the broker may take to redeliver a message, nack delays and retries
	// included, or Skip gives up on messages that were merely late.
	GapTimeout time.Duration

	// GapPolicy is what happens to a key when GapTimeout passes. Defaults to Wait.
	GapPolicy GapPolicy

	// SweepInterval is how often Run looks for keys whose gap timed out and retries parked
	// messages that failed. Defaults to DefaultSweepInterval, and to GapTimeout/2 when that is
	// shorter.
	SweepInterval time.Duration

	// MaxDrain bounds how many parked messages one transaction releases after the message
	// that fills their gap, so that a long backlog does not make that transaction outlive its
	// timeout or hold its locks for long. The rest are released by the sweeper, MaxDrain per
	// transaction, at its next pass. Defaults to DefaultMaxDrain.
	MaxDrain int

	// AllowUnkeyed lets messages without an ordering key and sequence through, processed
	// exactly once but in no particular order. Defaults to false: such a message is refused
	// with a permanent error wrapping ErrUnordered (dead-lettered), since a producer that
	// forgot the key would otherwise lose the ordering silently. A message with only one of
	// the two is refused either way.
	AllowUnkeyed bool

	// DeadLetterPublisher and DeadLetterTopic receive parked messages that the sweeper gives
	// up on: those of a key whose gap timed out under DeadLetter, a failing parked message
	// under Skip, and a parked message that fails with a permanent error. Required for Skip and
	// DeadLetter. With Wait and no publisher, a parked message that fails permanently stays
	// parked, and its key waits, until an operator acts.
	DeadLetterPublisher message.Publisher
	DeadLetterTopic     string

	// Forget deletes the duplicate-detection record of a message, in tx. The sweeper calls it
	// for each parked message it dead-letters: the message was recorded as processed when it
	// was parked, and its replay from the dead-letter topic must be processed. The router
	// sets it from the handler's dedup store. Defaults to none: a replayed message is then
	// taken for a duplicate until its record expires.
	Forget func(ctx context.Context, tx sqlx.ExtContext, msg *messagedata.MessageData) error

	// Logger receives the sweeper's logs. Defaults to slog.Default().
	Logger *slog.Logger

	// MeterProvider provides the meter of the onceflow.order.gap_timeouts counter. Defaults to
	// the global one.
	MeterProvider metric.MeterProvider

	// Now returns the current time, for parked_at and the gap timeout. Defaults to time.Now.
	// Tests set it.
	Now func() time.Time
}

// Validate reports the first invalid field of c, by name.
func (c Config) Validate() error {
	if err := checkText("Handler", c.Handler, MaxHandlerLen); err != nil {
		return fmt.Errorf("Handler: %w", err)
	}
	switch {
	case c.GapTimeout < 0:
		return fmt.Errorf("GapTimeout: %s is negative", c.GapTimeout)
	case c.SweepInterval < 0:
		return fmt.Errorf("SweepInterval: %s is negative", c.SweepInterval)
	case c.MaxDrain < 0:
		return fmt.Errorf("MaxDrain: %d is negative", c.MaxDrain)
	case c.GapPolicy < Wait || c.GapPolicy > DeadLetter:
		return fmt.Errorf("GapPolicy: %d is not a gap policy (want Wait, Skip or DeadLetter)", int(c.GapPolicy))
	case c.GapPolicy != Wait && (c.DeadLetterPublisher == nil || c.DeadLetterTopic == ""):
		return fmt.Errorf("DeadLetterPublisher: GapPolicy %s dead-letters parked messages; it needs a publisher and a topic", c.GapPolicy)
	}
	return nil
}

// InOrder applies the messages of each ordering key in the order of their sequence numbers,
// exactly once, for one handler. Middleware returns its interceptor; Run (or Sweep) handles
// keys whose gap does not fill. It is safe for concurrent use.
type InOrder struct {
	store       *Store
	cfg         Config
	now         func() time.Time
	next        atomic.Pointer[processor.Processor]
	timeouts    metric.Int64Counter
	sweepErrors metric.Int64Counter

	mu       sync.Mutex
	reported map[string]int64 // key -> blocked_since already reported as timed out (Wait)
}

// New returns the in-order interceptor of cfg.Handler on store.
func New(store *Store, cfg Config) (*InOrder, error) {
	if store == nil {
		return nil, errors.New("ordering.New: store is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("ordering.New: %w", err)
	}
	if cfg.GapTimeout == 0 {
		cfg.GapTimeout = DefaultGapTimeout
	}
	if cfg.SweepInterval == 0 {
		cfg.SweepInterval = min(DefaultSweepInterval, max(cfg.GapTimeout/2, time.Millisecond))
	}
	if cfg.MaxDrain == 0 {
		cfg.MaxDrain = DefaultMaxDrain
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	timeouts, err := telemetry.Meter(mp).Int64Counter(telemetry.MetricOrderGapTimeouts, metric.WithUnit("{key}"),
		metric.WithDescription("Keys whose next message was not applied within the gap timeout (missing, or parked and failing), by gap policy."))
	if err != nil {
		return nil, fmt.Errorf("ordering.New: create the gap timeout counter: %w", err)
	}
	sweepErrors, err := telemetry.Meter(mp).Int64Counter(telemetry.MetricOrderSweepErrors, metric.WithUnit("{key}"),
		metric.WithDescription("Keys whose sweep failed (a parked message that could not be applied or dead-lettered, a lost connection); the sweep goes on with the other keys and tries the key again next time."))
	if err != nil {
		return nil, fmt.Errorf("ordering.New: create the sweep error counter: %w", err)
	}
	o := &InOrder{store: store, cfg: cfg, now: cfg.Now, timeouts: timeouts, sweepErrors: sweepErrors, reported: map[string]int64{}}
	if o.now == nil {
		o.now = time.Now
	}
	return o, nil
}

// Store returns the interceptor's store.
func (o *InOrder) Store() *Store { return o.store }

// Handler returns the name of the interceptor's handler.
func (o *InOrder) Handler() string { return o.cfg.Handler }

// Config returns the interceptor's configuration, defaults applied.
func (o *InOrder) Config() Config { return o.cfg }

// Stats reads the parked messages of the handler (see Store.Stats).
func (o *InOrder) Stats(ctx context.Context) (Stats, error) { return o.store.Stats(ctx, o.cfg.Handler) }

// Middleware returns the in-order interceptor. It must run inside the transaction (after
// Transaction and Deduplicate, or after GroupCommit), and the chain inside it is what it
// applies, to the incoming message and to the parked messages it releases: wrap it around the
// processor only once, since Sweep applies parked messages through the same chain.
//
// For a message with ordering key K and sequence S, in the handler's transaction:
//
//   - it locks K's state row (creating it at 0), so the transactions of one key run one at a
//     time while other keys go on in parallel, on every consumer process;
//   - S is the next one (last applied + 1): it calls next, records S as applied, then applies,
//     in order and in the same transaction, the parked messages that now follow without a gap
//     (see below when one of them fails);
//   - S was applied already, or S is parked already: it returns an error wrapping
//     processor.ErrDuplicate (the router acks; nothing is applied twice). A sequence is the
//     identity of a message within its key: a second message with the same key and sequence
//     is a duplicate whatever its id;
//   - S comes early (a gap before it): it parks the message, its id, headers and payload, in
//     the parked table and returns nil, so the transaction commits (with the dedup record)
//     and the message is acknowledged: the broker does not redeliver it in a loop, and other
//     keys are not held up;
//   - S was skipped by the Skip gap policy before it arrived: a permanent error wrapping
//     ErrSkipped (dead-lettered).
//
// A message without key and sequence is refused with a permanent error wrapping ErrUnordered,
// unless Config.AllowUnkeyed. An error of next for the incoming message rolls everything back,
// as without ordering. A parked message whose processing fails (error or panic) while it is
// released is rolled back alone, to a savepoint set before the release: the incoming message
// and the parked messages before the failing one commit, the failing one stays parked with its
// error recorded and the key is stalled at it, until Sweep retries it.
func (o *InOrder) Middleware() middleware.Middleware {
	return func(next processor.Processor) processor.Processor {
		o.next.Store(&next)
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			return o.process(ctx, next, msg)
		})
	}
}

func (o *InOrder) process(ctx context.Context, next processor.Processor, msg *messagedata.MessageData) error {
	switch {
	case msg.Key == "" && msg.Sequence == 0:
		if o.cfg.AllowUnkeyed {
			return next.Process(ctx, msg)
		}
		return processor.Permanent(fmt.Errorf("%w: message %q has neither (headers %s and %s are empty)", ErrUnordered, msg.ID,
			messagedata.HeaderKey, messagedata.HeaderSequence))
	case msg.Key == "":
		return processor.Permanent(fmt.Errorf("%w: message %q has sequence %d but no ordering key (header %s)", ErrUnordered, msg.ID,
			msg.Sequence, messagedata.HeaderKey))
	case msg.Sequence == 0:
		return processor.Permanent(fmt.Errorf("%w: message %q has ordering key %s but no sequence (header %s)", ErrUnordered, msg.ID,
			textcol.Quote(msg.Key), messagedata.HeaderSequence))
	case msg.Sequence > MaxSequence:
		return processor.Permanent(fmt.Errorf("%w: sequence %d of message %q is larger than %d", ErrInvalidKey, msg.Sequence, msg.ID, int64(MaxSequence)))
	}
	if err := checkKey(o.cfg.Handler, msg.Key); err != nil {
		return processor.Permanent(fmt.Errorf("message %q: %w", msg.ID, err))
	}
	if err := checkText("message id", msg.ID, maxIDLen); err != nil {
		return processor.Permanent(fmt.Errorf("message %q: %w", msg.ID, err))
	}
	tx, ok := middleware.CurrentTx(ctx)
	if !ok {
		return fmt.Errorf("%w: place ExactlyOnceInOrder inside Transaction", middleware.ErrNoTransaction)
	}
	handler, key, seq := o.cfg.Handler, msg.Key, int64(msg.Sequence)

	st, err := o.store.lockKey(ctx, tx, handler, key)
	if err != nil {
		return err
	}
	switch {
	case seq <= st.last:
		sk, skipped, err := o.store.skippedAt(ctx, tx, handler, key, seq)
		if err != nil {
			return err
		}
		if skipped {
			return processor.Permanent(fmt.Errorf("%w: sequence %d of key %s arrived after sequences %d..%d were given up on at %s (%s)",
				ErrSkipped, seq, textcol.Quote(key), sk.From, sk.To, sk.SkippedAt.UTC().Format(time.RFC3339), sk.Reason))
		}
		return fmt.Errorf("%w: sequence %d of key %s was applied already (last applied: %d)", processor.ErrDuplicate, seq, textcol.Quote(key), st.last)
	case seq == st.last+1 && st.stalled:
		return fmt.Errorf("%w: sequence %d of key %s is parked already, waiting for a retry", processor.ErrDuplicate, seq, textcol.Quote(key))
	case seq > st.last+1:
		return o.park(ctx, tx, msg, st)
	}

	if err := next.Process(ctx, msg); err != nil {
		return err
	}
	st.last = seq
	if st.parked > 0 {
		if st, err = o.drain(ctx, tx, next, key, st, true); err != nil {
			return err
		}
	}
	return o.store.updateKey(ctx, tx, handler, key, st)
}

// park stores msg, which came before its predecessors, in the parked table.
func (o *InOrder) park(ctx context.Context, tx sqlx.ExtContext, msg *messagedata.MessageData, st keyState) error {
	var headers []byte
	if len(msg.Headers) > 0 {
		var err error
		if headers, err = json.Marshal(msg.Headers); err != nil {
			return processor.Permanent(fmt.Errorf("encode the headers of message %q: %w", msg.ID, err))
		}
	}
	now := o.now().UnixMicro()
	p := parkedMsg{Seq: int64(msg.Sequence), MessageID: msg.ID, Topic: msg.Topic, Headers: headers, Payload: msg.Payload, ParkedAt: now}
	if !msg.Timestamp.IsZero() {
		p.Timestamp = msg.Timestamp.UnixMicro()
	}
	if iid, ok := processor.InternalID(ctx); ok && iid != "" {
		p.InternalID.String, p.InternalID.Valid = iid, true
	}
	inserted, err := o.store.park(ctx, tx, o.cfg.Handler, msg.Key, p)
	if err != nil {
		return err
	}
	if !inserted {
		return fmt.Errorf("%w: sequence %d of key %s is parked already", processor.ErrDuplicate, msg.Sequence, textcol.Quote(msg.Key))
	}
	st.parked++
	if st.blocked == 0 {
		st.blocked = now
	}
	return o.store.updateKey(ctx, tx, o.cfg.Handler, msg.Key, st)
}
