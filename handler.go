package onceflow

import (
	"cmp"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// This file is long because it is all of a handler's configuration, documented field by field,
// with its validation: a reader finds every setting of a Handler here.

// maxHandlerName is the longest handler name; the name is part of every dedup key.
const maxHandlerName = 200

// Handler describes one message handler: where its messages come from, what processes them and
// with which guarantee.
type Handler struct {
	// Name identifies the handler in logs, metrics and duplicate-detection keys. Required,
	// unique within the router, at most 200 bytes. Renaming a handler makes every message new
	// to it.
	Name string

	// Topic is the topic (queue, subject, stream) to consume. Required.
	Topic string

	// Subscriber delivers the messages. Required. The router subscribes to Topic on it
	// Concurrency times.
	Subscriber message.Subscriber

	// Processor applies each message's effect. Required unless BatchProcessor is set.
	Processor processor.Processor

	// BatchProcessor, set instead of Processor, applies the effects of a group of messages in
	// one call and one transaction, so that it can write them with one multi-row statement
	// (processor.Batch documents what its result does to each message). It implies group
	// commit, whatever GroupCommit.Enabled says: the transaction stage runs one transaction per
	// group and hands the group's new messages to it (with Dedup.ByOffset a partition's
	// messages in offset order), so nothing may stand after the transaction stage but
	// duplicate detection by id or by offset. Not supported with BestEffort,
	// ExactlyOnceInOrder, Dedup.CheckFirst or Dedup.AckInTransaction.
	BatchProcessor processor.Batch

	// QoS is the quality of service: it chooses the canonical chain (QoS.Chain) and when a
	// message is acknowledged (BestEffort on receipt, every other level after the chain).
	// Required unless Chain is set; a Chain carries its own QoS, and QoS, when set too, must be
	// the same.
	QoS QoS

	// Chain is the chain of stages around the processor, outermost first: the canonical chain
	// of a quality of service, edited (see Chain):
	//
	//	Chain: onceflow.ExactlyOnce.Chain().Before(onceflow.StageRetry, onceflow.Use("tenant", tenant)),
	//
	// Defaults to QoS.Chain(). Which implementation each built-in stage takes is decided by the
	// fields below (GroupCommit, BatchProcessor, Dedup), so an edit holds whatever they say. A
	// field read by a stage that the chain does not hold is an error, naming the stage.
	Chain Chain

	// DB is the database the processor writes to, in whose transaction the message id is
	// recorded. Required by every built-in chain.
	DB *sqldb.DB

	// Concurrency is how many messages of this handler are processed at once; with group
	// commit (GroupCommit.Enabled or BatchProcessor), how many group transactions run at once.
	// The router subscribes to Topic that many times; each subscription holds up to the
	// broker's prefetch of deliveries (broker.Options.Prefetch), which wait for their turn.
	// Defaults to 1.
	Concurrency int

	// MaxDeliveries is how many times a message may be delivered without succeeding before it
	// is dead-lettered with the reason "delivery limit reached after N deliveries: <the last
	// error>" and acknowledged: a message that fails every time, panics every time, or makes
	// its consumer crash every time. The count comes from the broker where it counts
	// deliveries, and is otherwise kept durably in the handler's database (table
	// dedup.DefaultCounterTable), so that it survives a crash loop. Defaults to
	// DefaultMaxDeliveries (10); negative turns the limit off. The dead-letter stage applies
	// it; BestEffort's chain has none.
	MaxDeliveries int

	// Redelivery configures how long a failed message waits before it is delivered again.
	Redelivery RedeliveryConfig

	// Classifier tells errors that running a message again cannot cure (dead-lettered on first
	// sight) from the others (retried, then redelivered). Defaults to
	// middleware.DefaultClassifier, whose table says which is which. The retry stage reads it.
	Classifier middleware.Classifier

	// Dedup configures duplicate detection.
	Dedup DedupConfig

	// Retry configures in-process retries of retryable failures.
	Retry RetryConfig

	// GroupCommit configures group commit: concurrent deliveries of this handler share one
	// database transaction and one commit. Off by default.
	GroupCommit GroupCommitConfig

	// Order configures per-key ordering: the in-order stage of ExactlyOnceInOrder.
	Order OrderConfig

	// Timeout bounds each processing attempt. Defaults to no bound.
	Timeout time.Duration

	// Isolation is the transaction isolation level. Defaults to the database's default.
	Isolation sql.IsolationLevel

	// IDHeader is the header read for the message id when the message has no watermill UUID
	// (see package converter). Defaults to messagedata.HeaderID.
	IDHeader string

	// Converter turns the subscriber's messages into the MessageData the processor sees, and
	// says their ids. Defaults to converter.New with IDHeader; a
	// converter.New(converter.Config{ID: converter.JSONField("order_id")}) takes the id from
	// a business key in the payload instead, for producers that set no stable id. IDHeader
	// must be empty when Converter is set.
	Converter converter.MessageConverter

	// MessagingSystem is the messaging.system attribute of the handler's spans and
	// semantic-convention metrics, such as "rabbitmq". Defaults to what the Subscriber says
	// through a method MessagingSystem() string (the Subscribers of package broker say the
	// broker's name: rabbitmq, postgresql, mysql, sqlite, nats, redis), else
	// middleware.DefaultMessagingSystem. The consumer group, messaging.consumer.group.name,
	// comes the same way from a method ConsumerGroup() string, and is left out without one.
	MessagingSystem string
}

// DedupConfig configures duplicate detection for a handler.
type DedupConfig struct {
	// Table is the table that records processed message ids. Defaults to dedup.DefaultTable.
	// Handlers may share a table: the handler name is part of the key.
	Table string

	// Retention is how long a message id is remembered. Defaults to dedup.DefaultRetention. It
	// must outlive the longest time the broker may take to redeliver a message.
	Retention time.Duration

	// WithTimestamp makes the message timestamp part of the key, as a classic message_log table
	// does.
	WithTimestamp bool

	// CheckFirst selects the check-first id mapping: look the id up before writing,
	// mint an internal time-ordered id for new messages (processor.InternalID).
	CheckFirst bool

	// Store replaces the SQL store built from DB and Table, for tests and benchmarks.
	Store dedup.Store

	// BeyondRetention is what happens to a message delivered beyond Retention: its expired key
	// still recorded (a certain duplicate), or its timestamp older than Retention. Each is
	// counted in onceflow.dedup.beyond_retention and logged at WARN, then handled by the policy.
	// Defaults to middleware.DeadLetterExpiredKeys: dead-letter the certain duplicates, process
	// the old messages.
	BeyondRetention middleware.RetentionPolicy

	// UniqueConstraints, when set, detects duplicates by natural idempotency instead of a
	// dedup row: a unique violation of one of these constraints is taken for an earlier
	// delivery of the message (see middleware.NaturalIdempotency and sqldb.UniqueConstraint
	// for how each database names them). ExactlyOnce only.
	UniqueConstraints []string

	// ByOffset detects duplicates by position instead of by id, for brokers that deliver each
	// partition of a topic in order (Kafka): the handler's last applied offset in each
	// partition is kept in dedup.DefaultPositionsTable and updated in the transaction of each
	// message, and a message at or below it is a duplicate (see middleware.Offsets). No row
	// is written per message, so nothing needs purging, and a message needs no id. It takes
	// the deduplicate stage's place in the ExactlyOnce chain (with group commit or a batch
	// processor, the group's transaction keeps the positions itself); it does not go with
	// CheckFirst, WithTimestamp or another quality of service. The router gives the
	// handler's positions to its subscriber (redelivery.WithPositions): the Kafka subscriber
	// then starts each partition it is assigned after the offset applied there, and hands out
	// a partition's records in order, the next once the one before is acked, so that records
	// of one partition never run at once; Concurrency spreads the partitions over that many
	// members of the consumer group. With group commit (redelivery.WithPositionWindow), it
	// hands out up to its prefetch of a partition's records at once, in order: a group applies
	// a partition's consecutive records in offset order in one transaction and writes the
	// partition's position once, and a record that fails stops the ones behind it in its
	// partition, which come again after it (middleware.GroupOffsets).
	ByOffset bool

	// AckInTransaction acknowledges each message inside the handler's transaction instead of
	// recording its id, for the PostgreSQL and MySQL queues (package broker/sqlqueue) when the
	// queue lives in the handler's database: the queue's lease of the message is deleted with
	// the business writes, in one commit, so the message is consumed exactly when its effect
	// commits (see middleware.AckInTransaction). No dedup row is written and nothing needs
	// purging (BenchmarkSQLQueueExactlyOnce measures it beside a dedup row). The Subscriber
	// must be such a queue's, on the same database as DB. With group commit, each member's
	// lease is deleted in the group's one transaction (under its savepoint once a member has failed), and a member
	// that fails is rolled back with its lease, its message still queued. ExactlyOnce only,
	// without a batch processor, CheckFirst, WithTimestamp or ByOffset.
	AckInTransaction bool
}

// GroupCommitConfig configures group commit for a handler (see middleware.GroupCommit): the
// deliveries waiting for the handler share one transaction, their ids are recorded with one
// statement, and each message is acknowledged only after the one commit. Up to Concurrency
// groups run at once; the deliveries that arrive meanwhile, up to the broker's prefetch per
// subscription, form the next ones. A message that fails is rolled back alone: its group runs
// again without it. It pays off when the commit dominates the processing time of a message; it
// loses when the processor waits on something else (a remote call, a slow query), since a
// group's messages run one after the other on one connection.
type GroupCommitConfig struct {
	// Enabled makes the chain's transaction stage run one transaction per group, which also
	// records the ids (or with Dedup.ByOffset the positions) of its messages. Defaults to false.
	// Not supported with Dedup.CheckFirst.
	Enabled bool

	// MaxSize is the most messages in one group. Defaults to middleware.DefaultMaxGroupSize
	// (64).
	MaxSize int

	// MaxWait is how long a group that is not full waits for more messages after its first,
	// when one of the handler's Concurrency transactions is free. Defaults to
	// middleware.DefaultMaxGroupWait (0: it starts at once; the messages that arrive while
	// every transaction is busy form the next group). With the default, the first deliveries of
	// each subscription form groups of their own, one running at a time, the next collecting
	// what arrives meanwhile; with MaxWait set, a group collects the deliveries of every
	// subscription, for up to MaxWait.
	MaxWait time.Duration
}

// DefaultMaxDeliveries is the delivery limit of a handler whose MaxDeliveries is zero.
const DefaultMaxDeliveries = 10

// DefaultRedeliveryDelays are the waits before a failed message is delivered again, by the
// delivery that failed: 1 s after the first, 5 s after the second, 30 s after the third, and
// 2 min after each later one.
var DefaultRedeliveryDelays = []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 2 * time.Minute}

// RedeliveryConfig configures the delay before a failed message (an error that its in-process
// retries did not cure, or a panic) is delivered again. The delay grows with the message's
// delivery count, so that a message that keeps failing stops spinning while the messages
// behind it keep flowing. Brokers that can delay a redelivery do it themselves (NATS, Redis,
// the SQL and SQLite queues: the message is nacked at once and stays invisible for the delay);
// for the others (RabbitMQ) the subscriber holds the message for the delay, then nacks it.
type RedeliveryConfig struct {
	// Delays are the waits after the first, second, ... failed delivery; the last one repeats.
	// Defaults to DefaultRedeliveryDelays. A message whose delivery count is unknown waits the
	// first.
	Delays []time.Duration
}

// delay returns the wait before the delivery after delivery number n (1 for the first; 0
// unknown).
func (c RedeliveryConfig) delay(n int) time.Duration {
	delays := c.Delays
	if len(delays) == 0 {
		delays = DefaultRedeliveryDelays
	}
	return delays[min(max(n, 1), len(delays))-1]
}

// RetryConfig configures the in-process retries of a handler.
type RetryConfig struct {
	// MaxAttempts is how many times a delivery is processed before it is nacked, the first
	// attempt included. Defaults to 3.
	MaxAttempts int
	// InitialInterval is the wait before the first retry; it doubles, with jitter, up to
	// MaxInterval. Defaults to 100 ms.
	InitialInterval time.Duration
	// MaxInterval is the longest wait between attempts. Defaults to 5 s.
	MaxInterval time.Duration
}

// Validate reports the first invalid field of h, by name: a value out of range, a Chain that
// is not valid or does not match QoS, a setting that the chain would ignore (the stage that
// reads it is not in the chain), and a chain that cannot run with the other settings.
func (h Handler) Validate() error {
	switch {
	case h.Name == "":
		return errors.New("Handler.Name: empty")
	case len(h.Name) > maxHandlerName:
		return fmt.Errorf("Handler.Name: %d bytes, longer than %d", len(h.Name), maxHandlerName)
	case h.Topic == "":
		return fmt.Errorf("Handler.Topic: empty (handler %q)", h.Name)
	case !validTopic(h.Topic):
		return fmt.Errorf("Handler.Topic: %q is not a valid topic name (letters, digits, '_', '-' and '.')", h.Topic)
	case h.Subscriber == nil:
		return fmt.Errorf("Handler.Subscriber: nil (handler %q)", h.Name)
	case h.Processor == nil && h.BatchProcessor == nil:
		return fmt.Errorf("Handler.Processor: nil (handler %q; set Processor or BatchProcessor)", h.Name)
	case h.Processor != nil && h.BatchProcessor != nil:
		return fmt.Errorf("Handler.BatchProcessor: set together with Processor (handler %q; set one of them)", h.Name)
	case h.Chain.isZero() && !h.QoS.Valid():
		return fmt.Errorf("Handler.QoS: %s is not a quality of service (handler %q; want BestEffort, AtLeastOnce, ExactlyOnce or ExactlyOnceInOrder, or set Chain)", h.QoS, h.Name)
	case !h.Chain.isZero() && h.Chain.Err() != nil:
		return fmt.Errorf("Handler.Chain: %w (handler %q)", h.Chain.Err(), h.Name)
	case !h.Chain.isZero() && h.QoS != 0 && h.QoS != h.Chain.qos:
		return fmt.Errorf("Handler.QoS: %s, but Handler.Chain is the chain of %s (handler %q; leave QoS zero, or make them agree)", h.QoS, h.Chain.qos, h.Name)
	case h.DB == nil:
		return fmt.Errorf("Handler.DB: nil (handler %q needs the database its transaction runs on)", h.Name)
	case h.Concurrency < 0:
		return fmt.Errorf("Handler.Concurrency: %d is negative", h.Concurrency)
	case h.Timeout < 0:
		return fmt.Errorf("Handler.Timeout: %s is negative", h.Timeout)
	case h.Retry.MaxAttempts < 0:
		return fmt.Errorf("Handler.Retry.MaxAttempts: %d is negative", h.Retry.MaxAttempts)
	case h.Retry.InitialInterval < 0 || h.Retry.MaxInterval < 0:
		return errors.New("Handler.Retry: negative interval")
	case h.Retry.MaxInterval > 0 && cmp.Or(h.Retry.InitialInterval, middleware.DefaultRetryInitialInterval) > h.Retry.MaxInterval:
		return fmt.Errorf("Handler.Retry.MaxInterval: %s is shorter than the first wait, %s (InitialInterval, or middleware.DefaultRetryInitialInterval when zero) (handler %q)",
			h.Retry.MaxInterval, cmp.Or(h.Retry.InitialInterval, middleware.DefaultRetryInitialInterval), h.Name)
	case slices.ContainsFunc(h.Redelivery.Delays, func(d time.Duration) bool { return d < 0 }):
		return fmt.Errorf("Handler.Redelivery.Delays: %v holds a negative delay (handler %q)", h.Redelivery.Delays, h.Name)
	case !h.Dedup.BeyondRetention.Valid():
		return fmt.Errorf("Handler.Dedup.BeyondRetention: %s is not a retention policy (handler %q)", h.Dedup.BeyondRetention, h.Name)
	case h.Converter != nil && h.IDHeader != "":
		return fmt.Errorf("Handler.IDHeader: set together with Converter (handler %q; give the converter its IDHeader)", h.Name)
	case h.Dedup.Retention < 0:
		return fmt.Errorf("Handler.Dedup.Retention: %s is negative", h.Dedup.Retention)
	case h.GroupCommit.MaxSize < 0:
		return fmt.Errorf("Handler.GroupCommit.MaxSize: %d is negative", h.GroupCommit.MaxSize)
	case h.GroupCommit.MaxWait < 0:
		return fmt.Errorf("Handler.GroupCommit.MaxWait: %s is negative", h.GroupCommit.MaxWait)
	}
	if h.Dedup.Table != "" {
		if err := sqldb.CheckIdentifier("Handler.Dedup.Table", h.Dedup.Table); err != nil {
			return err
		}
	}
	if err := h.Order.validate(h.Name); err != nil {
		return err
	}
	return h.checkChain()
}

// chain returns the chain of h: Chain, or the canonical chain of QoS.
func (h Handler) chain() Chain {
	if h.Chain.isZero() {
		return h.QoS.Chain()
	}
	return h.Chain
}

// qos returns the quality of service of h, which its chain carries.
func (h Handler) qos() QoS { return h.chain().qos }

// isZero reports whether c is the zero Chain, which holds nothing.
func (c Chain) isZero() bool { return c.qos == 0 && c.err == nil && c.stages == nil }

// checkChain reports a setting of h that its chain would ignore, and a chain that cannot run
// with h's other settings.
func (h Handler) checkChain() error {
	c := h.chain()
	p := planOf(h)
	for i := range builtins {
		b := &builtins[i]
		if b.settings == nil || c.builtin(b.name) != nil {
			continue
		}
		if set := b.settings(h); len(set) > 0 {
			return fmt.Errorf("%s: set, but %s, which reads it (handler %q; leave %s zero)", set[0], whyAbsent(c, b), h.Name, set[0])
		}
	}
	q := c.qos
	switch {
	case q == BestEffort && len(h.Redelivery.Delays) > 0:
		return fmt.Errorf("Handler.Redelivery.Delays: set, but BestEffort acknowledges each message on receipt, so none is redelivered (handler %q)", h.Name)
	case h.BatchProcessor != nil && (q == BestEffort || q == ExactlyOnceInOrder):
		return fmt.Errorf("Handler.BatchProcessor: not supported with %s (handler %q; use ExactlyOnce or AtLeastOnce)", q, h.Name)
	case (h.GroupCommit.MaxSize != 0 || h.GroupCommit.MaxWait != 0) && !p.group:
		return fmt.Errorf("Handler.GroupCommit: MaxSize or MaxWait set, but group commit is off (handler %q; set GroupCommit.Enabled or a BatchProcessor)", h.Name)
	case p.group && p.dedup == dedupCheckFirst:
		return fmt.Errorf("Handler.Dedup.CheckFirst: not supported with group commit (handler %q; a group records its ids with one multi-row insert, without internal ids)", h.Name)
	case (p.dedup == dedupByOffset || p.dedup == dedupAckInTx || p.dedup == dedupNatural) && q != ExactlyOnce:
		return fmt.Errorf("Handler.Dedup: %s applies to the ExactlyOnce chain (handler %q)", p.dedup, h.Name)
	case p.dedup == dedupByOffset && (h.Dedup.CheckFirst || h.Dedup.WithTimestamp || h.Dedup.AckInTransaction):
		return fmt.Errorf("Handler.Dedup.ByOffset: not supported with Dedup.CheckFirst, Dedup.WithTimestamp or Dedup.AckInTransaction (handler %q)", h.Name)
	case p.dedup == dedupAckInTx && (h.BatchProcessor != nil || h.Dedup.CheckFirst || h.Dedup.WithTimestamp):
		return fmt.Errorf("Handler.Dedup.AckInTransaction: not supported with a batch processor, Dedup.CheckFirst or Dedup.WithTimestamp (handler %q)", h.Name)
	}
	if h.BatchProcessor != nil {
		if c.builtin(StageTransaction) == nil {
			return fmt.Errorf("Handler.BatchProcessor: set, but %s, which hands it a group's messages (handler %q)", whyAbsent(c, builtinNamed(StageTransaction)), h.Name)
		}
		inside := false
		for _, s := range c.stages {
			if inside && (s.b == nil || s.b.name != StageDeduplicate || p.dedup == dedupNatural) {
				return fmt.Errorf("Handler.BatchProcessor: stage %s is inside the transaction, where the group hands its messages to the batch processor at once (handler %q; place it before %s, or set Processor instead)",
					s.name, h.Name, StageTransaction)
			}
			inside = inside || s.b != nil && s.b.name == StageTransaction
		}
	}
	return nil
}

// whyAbsent says why chain c does not hold the built-in stage b, and what holds it.
func whyAbsent(c Chain, b *builtin) string {
	for _, s := range c.stages {
		if s.takes == b.name {
			return fmt.Sprintf("the chain's %s stage is %q, a stage of one's own", b.name, s.name)
		}
	}
	if slices.Contains(b.levels, c.qos) {
		return fmt.Sprintf("the chain has no %s stage (keep it)", b.name)
	}
	var levels []string
	for _, q := range b.levels {
		levels = append(levels, q.String())
	}
	return fmt.Sprintf("the chain of %s has no %s stage (the chains of %s have one)", c.qos, b.name, strings.Join(levels, " and "))
}

// The settings each built-in stage reads, for the table builtins: the fields of h that are set,
// by name as they are written.

func deadLetterSettings(h Handler) []string {
	return setFields(field{"Handler.MaxDeliveries", h.MaxDeliveries != 0})
}

func retrySettings(h Handler) []string {
	return setFields(
		field{"Handler.Retry.MaxAttempts", h.Retry.MaxAttempts != 0},
		field{"Handler.Retry.InitialInterval", h.Retry.InitialInterval != 0},
		field{"Handler.Retry.MaxInterval", h.Retry.MaxInterval != 0},
		field{"Handler.Classifier", h.Classifier != nil},
	)
}

func timeoutSettings(h Handler) []string {
	return setFields(field{"Handler.Timeout", h.Timeout != 0})
}

func transactionSettings(h Handler) []string {
	return setFields(
		field{"Handler.Isolation", h.Isolation != 0},
		field{"Handler.GroupCommit.Enabled", h.GroupCommit.Enabled},
	)
}

// dedupSettings are the fields of Handler.Dedup that are set; those of its table (Table,
// Retention, WithTimestamp, Store) are read by the in-order stage too.
func dedupSettings(h Handler) []string {
	d := h.Dedup
	fields := []field{
		{"Handler.Dedup.CheckFirst", d.CheckFirst},
		{"Handler.Dedup.ByOffset", d.ByOffset},
		{"Handler.Dedup.AckInTransaction", d.AckInTransaction},
		{"Handler.Dedup.UniqueConstraints", len(d.UniqueConstraints) > 0},
		{"Handler.Dedup.BeyondRetention", d.BeyondRetention != 0},
	}
	if h.chain().builtin(StageInOrder) == nil {
		fields = append(fields,
			field{"Handler.Dedup.Table", d.Table != ""},
			field{"Handler.Dedup.Retention", d.Retention != 0},
			field{"Handler.Dedup.WithTimestamp", d.WithTimestamp},
			field{"Handler.Dedup.Store", d.Store != nil},
		)
	}
	return setFields(fields...)
}

func orderSettings(h Handler) []string {
	return setFields(field{"Handler.Order", h.Order != (OrderConfig{})})
}

// field is a field of a Handler by name, and whether it is set.
type field struct {
	name string
	set  bool
}

// setFields returns the names of the fields that are set.
func setFields(fields ...field) []string {
	var set []string
	for _, f := range fields {
		if f.set {
			set = append(set, f.name)
		}
	}
	return set
}

func (m dedupMode) String() string {
	return [...]string{"none", "by id", "check-first", "Dedup.ByOffset", "Dedup.AckInTransaction", "Dedup.UniqueConstraints (natural idempotency)"}[m]
}

// converter returns the handler's converter: Converter, or the default one for IDHeader, which
// logs to logger.
func (h Handler) converter(logger *slog.Logger) converter.MessageConverter {
	if h.Converter != nil {
		return h.Converter
	}
	return converter.New(converter.Config{IDHeader: h.IDHeader, Logger: logger})
}

// OrderConfig configures per-key ordering for a handler: the in-order stage of
// ExactlyOnceInOrder (package ordering). The zero value is valid.
type OrderConfig struct {
	// GapTimeout is how long a key may wait for its next message (missing, or parked and
	// failing) before GapPolicy applies. Defaults to ordering.DefaultGapTimeout (5 min). It
	// should exceed the longest time the broker takes to redeliver a message.
	GapTimeout time.Duration

	// GapPolicy is what happens to a key whose wait passed GapTimeout: ordering.Wait (the
	// default) keeps waiting, ordering.Skip gives up on the missing sequences and applies what
	// follows, ordering.DeadLetter moves the key's parked messages to the dead-letter topic.
	// The timeout is logged and counted in onceflow.order.gap_timeouts whatever the policy.
	GapPolicy ordering.GapPolicy

	// SweepInterval is how often the router's sweeper retries stalled keys and looks for
	// timed-out gaps. Defaults to ordering.DefaultSweepInterval (10 s), or GapTimeout/2 when
	// shorter. A negative value starts no sweeper: call ordering.InOrder.Sweep yourself.
	SweepInterval time.Duration

	// MaxDrain bounds how many parked messages the transaction of the message that fills their
	// gap applies; the sweeper releases the rest. Defaults to ordering.DefaultMaxDrain (1000).
	MaxDrain int

	// AllowUnkeyed processes messages without an ordering key and sequence exactly once, in no
	// particular order. Defaults to false: they are dead-lettered.
	AllowUnkeyed bool

	// Table is the prefix of the ordering tables. Defaults to ordering.DefaultTable
	// (onceflow_order_state, _parked, _skipped). Handlers may share them.
	Table string
}

func (c OrderConfig) validate(handler string) error {
	switch {
	case c.GapTimeout < 0:
		return fmt.Errorf("Handler.Order.GapTimeout: %s is negative (handler %q)", c.GapTimeout, handler)
	case c.MaxDrain < 0:
		return fmt.Errorf("Handler.Order.MaxDrain: %d is negative (handler %q)", c.MaxDrain, handler)
	case c.GapPolicy < ordering.Wait || c.GapPolicy > ordering.DeadLetter:
		return fmt.Errorf("Handler.Order.GapPolicy: %s is not a gap policy (handler %q; want ordering.Wait, Skip or DeadLetter)", c.GapPolicy, handler)
	}
	if err := (ordering.StoreConfig{Table: c.Table}).Validate(); err != nil {
		return fmt.Errorf("Handler.Order.%w", err)
	}
	return nil
}
