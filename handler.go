package onceflow

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/internal/groupcommit"
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
	// commit (GroupCommit.Disabled must not be set): the transaction stage runs one transaction per
	// group and hands the group's new messages to it (with DedupByOffset a partition's
	// messages in offset order), so nothing may stand after the transaction stage but
	// duplicate detection by id or by offset. Not supported with BestEffort,
	// ExactlyOnceInOrder, DedupCheckFirst, DedupAckInTransaction or DedupNatural.
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
	// commit (the default), how many group transactions run at once.
	// The router subscribes to Topic that many times; each subscription holds up to the
	// broker's prefetch of deliveries (broker.Options.Prefetch), which wait for their turn. A
	// prefetch left unset follows from the handler: the router asks each subscription for its
	// share of the deliveries the handler takes at once (redelivery.WithWindow; with group
	// commit, twice GroupCommit.MaxSize), which a broker holds when its default is smaller.
	// Defaults to 1.
	Concurrency int

	// DeadLetter configures the dead-letter stage: the delivery limit, and which errors are
	// permanent (dead-lettered on first sight). A message that fails every time, panics every
	// time, or makes its consumer crash every time is dead-lettered at the limit; the count
	// comes from the broker where it counts deliveries, and is otherwise kept durably in the
	// handler's database (table dedup.DefaultCounterTable), so that it survives a crash loop.
	DeadLetter middleware.DeadLetter

	// Redelivery configures how long a failed message waits before it is delivered again.
	Redelivery RedeliveryConfig

	// Retry configures the retry stage: in-process retries of retryable failures.
	Retry middleware.Retry

	// Timeout bounds each processing attempt: the timeout stage. Defaults to no bound.
	Timeout time.Duration

	// Transaction configures the transaction stage, whatever runs it (one transaction per
	// message, or per group with group commit).
	Transaction middleware.Transaction

	// GroupCommit configures group commit: concurrent deliveries of this handler share one
	// database transaction and one commit. On by default wherever the chain has the built-in
	// transaction stage; GroupCommit.Disabled turns it off.
	GroupCommit GroupCommitConfig

	// Dedup configures the deduplicate stage: duplicate detection in the transaction, by
	// Dedup.Mode. The router keeps one dedup table per database and Dedup.Table, shared by the
	// handlers that name it, and creates it when it runs. Under group commit, the group's
	// transaction records the ids (DedupInsertFirst) or the positions (DedupByOffset) of its
	// messages itself; DedupCheckFirst does not go with group commit: with it, each message
	// has a transaction of its own. DedupByOffset,
	// DedupAckInTransaction and DedupNatural apply to the ExactlyOnce chain only.
	//
	// With DedupByOffset the router gives the handler's positions to its subscriber
	// (redelivery.WithPositions): the Kafka subscriber then starts each partition it is
	// assigned after the offset applied there, and hands out a partition's records in order,
	// the next once the one before is acked, so that records of one partition never run at
	// once; Concurrency spreads the partitions over that many members of the consumer group.
	// With group commit (redelivery.WithPositionWindow), it hands out up to its prefetch of a
	// partition's records at once, in order: a group applies a partition's consecutive records
	// in offset order in one transaction and writes the partition's position once, and a record
	// that fails stops the ones behind it in its partition, which come again after it.
	//
	// DedupAckInTransaction needs the PostgreSQL or MySQL queue (package broker/sqlqueue) of
	// the handler's own database as Subscriber: the queue's lease of the message is deleted with
	// the business writes, in one commit (BenchmarkSQLQueueExactlyOnce measures it beside a
	// dedup row). With group commit, each member's lease is deleted in the group's one
	// transaction (under its savepoint once a member has failed), and a member that fails is
	// rolled back with its lease, its message still queued. It does not go with a batch
	// processor, nor does DedupNatural.
	Dedup middleware.Dedup

	// Order configures per-key ordering: the in-order stage of ExactlyOnceInOrder.
	Order OrderConfig

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

// GroupCommitConfig configures group commit for a handler, which is on by default: the
// deliveries waiting for the handler share one transaction, their ids are recorded with one
// statement, and each message is acknowledged only after the one commit. Up to Concurrency
// groups run at once; the deliveries that arrive meanwhile form the next ones. A message that
// fails is rolled back alone: its group runs again without it, so the processor runs again for
// the group's other messages (docs/concepts.md#group-commit says how often). Their database
// writes commit once; an effect outside the database (an HTTP call, a file) is repeated, as it
// is when the retry stage runs a failed message again. Set Disabled to give every message a
// transaction of its own: for a processor with such an effect that must not be repeated for
// another message's failure, or whose messages fail often. Group commit is off, whatever
// Disabled says, in a chain without the built-in transaction stage and with DedupCheckFirst.
type GroupCommitConfig struct {
	// Disabled gives every message a transaction of its own, committed alone. Defaults to
	// false: the chain's transaction stage runs one transaction per group, which also records
	// the ids (or with DedupByOffset the positions) of its messages. Not with a
	// BatchProcessor, which runs groups.
	Disabled bool

	// MaxSize is the most messages in one group. Defaults to 64. 1 gives every message a
	// transaction of its own.
	MaxSize int

	// MaxWait is how long a group that is not full waits for more messages after its first,
	// when one of the handler's Concurrency transactions is free. Defaults to 0: it starts at
	// once; the messages that arrive while every transaction is busy form the next group. With
	// the default, the first deliveries of each subscription form groups of their own, one
	// running at a time, the next collecting what arrives meanwhile; with MaxWait set, a group
	// collects the deliveries of every subscription, for up to MaxWait.
	MaxWait time.Duration
}

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

// validate reports the first invalid field of c, by name.
func (c GroupCommitConfig) validate() error {
	switch {
	case c.MaxSize < 0:
		return fmt.Errorf("MaxSize: %d is negative", c.MaxSize)
	case c.MaxWait < 0:
		return fmt.Errorf("MaxWait: %s is negative", c.MaxWait)
	}
	return nil
}

// maxSize returns the most messages in one of c's groups.
func (c GroupCommitConfig) maxSize() int { return cmp.Or(c.MaxSize, groupcommit.DefaultMaxSize) }

// validate reports the first invalid field of c, by name.
func (c RedeliveryConfig) validate() error {
	if slices.ContainsFunc(c.Delays, func(d time.Duration) bool { return d < 0 }) {
		return fmt.Errorf("Delays: %v holds a negative delay", c.Delays)
	}
	return nil
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
	case h.Converter != nil && h.IDHeader != "":
		return fmt.Errorf("Handler.IDHeader: set together with Converter (handler %q; give the converter its IDHeader)", h.Name)
	}
	for _, c := range []struct {
		field string
		err   error
	}{
		{"Retry", h.Retry.Validate()},
		{"Redelivery", h.Redelivery.validate()},
		{"Dedup", h.Dedup.Validate()},
		{"GroupCommit", h.GroupCommit.validate()},
		{"Order", h.Order.validate()},
	} {
		if c.err != nil {
			return fmt.Errorf("Handler.%s.%w (handler %q)", c.field, c.err, h.Name)
		}
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
			why, advice := whyAbsent(c, b)
			return fmt.Errorf("%s: set, but %s, which reads it (handler %q; %s, or leave %s zero)", set[0], why, h.Name, advice, set[0])
		}
	}
	q := c.qos
	switch {
	case q == BestEffort && len(h.Redelivery.Delays) > 0:
		return fmt.Errorf("Handler.Redelivery.Delays: set, but BestEffort acknowledges each message on receipt, so none is redelivered (handler %q)", h.Name)
	case h.BatchProcessor != nil && (q == BestEffort || q == ExactlyOnceInOrder):
		return fmt.Errorf("Handler.BatchProcessor: not supported with %s (handler %q; use ExactlyOnce or AtLeastOnce)", q, h.Name)
	case h.GroupCommit.Disabled && h.BatchProcessor != nil:
		return fmt.Errorf("Handler.GroupCommit.Disabled: set with a BatchProcessor, which runs groups (handler %q; set Processor instead, or leave Disabled false)", h.Name)
	case (h.GroupCommit.MaxSize != 0 || h.GroupCommit.MaxWait != 0) && !p.group:
		field := "MaxSize"
		if h.GroupCommit.MaxSize == 0 {
			field = "MaxWait"
		}
		why := "GroupCommit.Disabled is set"
		if !h.GroupCommit.Disabled {
			why = "the handler's Dedup.Mode, " + p.dedup.String() + ", gives each message a transaction of its own"
		}
		return fmt.Errorf("Handler.GroupCommit.%s: set, but group commit is off: %s (handler %q; leave %s zero)", field, why, h.Name, field)
	case p.group && p.dedup == middleware.DedupCheckFirst:
		return fmt.Errorf("Handler.Dedup.Mode: DedupCheckFirst is not supported with group commit (handler %q; a group records its ids with one multi-row insert, without internal ids)", h.Name)
	case p.hasDedup && !p.dedup.RecordsIDs() && q != ExactlyOnce:
		return fmt.Errorf("Handler.Dedup.Mode: %s applies to the ExactlyOnce chain (handler %q)", p.dedup, h.Name)
	case p.hasDedup && (p.dedup == middleware.DedupAckInTransaction || p.dedup == middleware.DedupNatural) && h.BatchProcessor != nil:
		return fmt.Errorf("Handler.Dedup.Mode: %s is not supported with a batch processor (handler %q; it runs member by member, inside the transaction)", p.dedup, h.Name)
	}
	if h.BatchProcessor != nil {
		if c.builtin(StageTransaction) == nil {
			why, advice := whyAbsent(c, builtinNamed(StageTransaction))
			return fmt.Errorf("Handler.BatchProcessor: set, but %s, which hands it a group's messages (handler %q; %s, or set Processor instead)", why, h.Name, advice)
		}
		inside := false
		for _, s := range c.stages {
			if inside && (s.b == nil || s.b.name != StageDeduplicate) {
				return fmt.Errorf("Handler.BatchProcessor: stage %s is inside the transaction, where the group hands its messages to the batch processor at once (handler %q; place it before %s, or set Processor instead)",
					s.name, h.Name, StageTransaction)
			}
			inside = inside || s.b != nil && s.b.name == StageTransaction
		}
	}
	return nil
}

// whyAbsent says why chain c does not hold the built-in stage b, and what to do to have it.
func whyAbsent(c Chain, b *builtin) (why, advice string) {
	for _, s := range c.stages {
		if s.takes == b.name {
			return fmt.Sprintf("the chain's %s stage is %q, a stage of one's own", b.name, s.name),
				fmt.Sprintf("configure %q itself, or keep the built-in %s stage", s.name, b.name)
		}
	}
	if slices.Contains(b.levels, c.qos) {
		return fmt.Sprintf("the chain has no %s stage", b.name), fmt.Sprintf("keep the %s stage in Handler.Chain", b.name)
	}
	var levels []string
	for _, q := range b.levels {
		levels = append(levels, q.String())
	}
	return fmt.Sprintf("the chain of %s has no %s stage", c.qos, b.name),
		fmt.Sprintf("use %s, whose chains have one", strings.Join(levels, " or "))
}

// The settings each built-in stage reads, for the table builtins: the fields of h that are set,
// by name as they are written.

func deadLetterSettings(h Handler) []string {
	return setFields(
		field{"Handler.DeadLetter.MaxDeliveries", h.DeadLetter.MaxDeliveries != 0},
		field{"Handler.DeadLetter.Classifier", h.DeadLetter.Classifier != nil},
	)
}

func retrySettings(h Handler) []string {
	return setFields(
		field{"Handler.Retry.MaxAttempts", h.Retry.MaxAttempts != 0},
		field{"Handler.Retry.InitialInterval", h.Retry.InitialInterval != 0},
		field{"Handler.Retry.MaxInterval", h.Retry.MaxInterval != 0},
	)
}

func timeoutSettings(h Handler) []string {
	return setFields(field{"Handler.Timeout", h.Timeout != 0})
}

func transactionSettings(h Handler) []string {
	return setFields(
		field{"Handler.Transaction.Isolation", h.Transaction.Isolation != 0},
		field{"Handler.GroupCommit.Disabled", h.GroupCommit.Disabled},
	)
}

// dedupSettings are the fields of Handler.Dedup that are set; those of its table (Table,
// Retention, WithTimestamp, Store) are read by the in-order stage too.
func dedupSettings(h Handler) []string {
	d := h.Dedup
	fields := []field{
		{"Handler.Dedup.Mode", d.Mode != 0},
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

// converter returns the handler's converter: Converter, or the default one for IDHeader, which
// logs to logger.
func (h Handler) converter(logger *slog.Logger) converter.MessageConverter {
	if h.Converter != nil {
		return h.Converter
	}
	system, _ := describeBroker(h)
	return converter.New(converter.Config{IDHeader: h.IDHeader, System: system, Logger: logger})
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

func (c OrderConfig) validate() error {
	switch {
	case c.GapTimeout < 0:
		return fmt.Errorf("GapTimeout: %s is negative", c.GapTimeout)
	case c.MaxDrain < 0:
		return fmt.Errorf("MaxDrain: %d is negative", c.MaxDrain)
	case c.GapPolicy < ordering.Wait || c.GapPolicy > ordering.DeadLetter:
		return fmt.Errorf("GapPolicy: %s is not a gap policy (want ordering.Wait, Skip or DeadLetter)", c.GapPolicy)
	}
	return (ordering.StoreConfig{Table: c.Table}).Validate()
}
