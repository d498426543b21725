package onceflow

import (
	"cmp"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
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
	// commit: the QoS chain uses "group-commit" ("group-transaction" for AtLeastOnce,
	// "group-offsets" with Dedup.ByOffset, which hands it a partition's messages in offset
	// order), whatever GroupCommit.Enabled says, and a chain named in Interceptors must end with
	// one of them. Not supported with BestEffort, ExactlyOnceInOrder, Dedup.CheckFirst or
	// Dedup.AckInTransaction.
	BatchProcessor processor.Batch

	// QoS selects the canonical chain of interceptors for the quality of service. Required
	// unless Interceptors is set. With Interceptors set, QoS only decides when the message is
	// acknowledged: BestEffort acks on receipt, every other level after the chain.
	QoS QoS

	// Interceptors, when set, replaces the QoS chain with interceptors named here, outermost
	// first, as Spring's interceptorNames list does (docs/background.md). The built-in names are listed in Interceptor*
	// constants; Router.RegisterInterceptor adds custom ones. "deduplicate" must come after
	// "transaction", and "retry" before it; "group-commit" replaces both "transaction" and
	// "deduplicate", with "retry" before it.
	Interceptors []string

	// Middlewares are middleware values of this handler, each under the name that
	// Interceptors lists it by, where it takes its place in the chain: the way to put a
	// middleware built in code into a handler's chain without registering a factory
	// (Router.RegisterInterceptor). An interceptor is a named middleware factory; an entry
	// here is a named middleware, built once. A name must not be a built-in or registered
	// interceptor's, and must appear in Interceptors.
	Middlewares map[string]middleware.Middleware

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
	// DefaultMaxDeliveries (10); negative turns the limit off. It applies to chains with the
	// "deadletter" interceptor; BestEffort has none.
	MaxDeliveries int

	// Redelivery configures how long a failed message waits before it is delivered again.
	Redelivery RedeliveryConfig

	// Classifier tells errors that running a message again cannot cure (dead-lettered on first
	// sight) from the others (retried, then redelivered). Defaults to
	// middleware.DefaultClassifier, whose table says which is which.
	Classifier middleware.Classifier

	// Dedup configures duplicate detection.
	Dedup DedupConfig

	// Retry configures in-process retries of retryable failures.
	Retry RetryConfig

	// GroupCommit configures group commit: concurrent deliveries of this handler share one
	// database transaction and one commit. Off by default.
	GroupCommit GroupCommitConfig

	// Order configures per-key ordering: the "in-order" interceptor of ExactlyOnceInOrder.
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

	// UniqueConstraints names the unique constraints whose violation the "natural-idempotency"
	// interceptor takes for an earlier delivery of the message (see
	// middleware.NaturalIdempotency and sqldb.UniqueConstraint for how each database names
	// them). Required by that interceptor.
	UniqueConstraints []string

	// ByOffset detects duplicates by position instead of by id, for brokers that deliver each
	// partition of a topic in order (Kafka): the handler's last applied offset in each
	// partition is kept in dedup.DefaultPositionsTable and updated in the transaction of each
	// message, and a message at or below it is a duplicate (see middleware.Offsets). No row
	// is written per message, so nothing needs purging, and a message needs no id. It takes
	// the place of the "deduplicate" interceptor in the ExactlyOnce chain ("group-offsets"
	// takes the place of "group-commit" with group commit or a batch processor); it does not go
	// with CheckFirst, WithTimestamp or another quality of service. The router gives the
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
	// must be such a queue's, on the same database as DB. With group commit, the chain runs
	// "group-transaction" followed by "ack-in-transaction": each member's lease is deleted in
	// the group's one transaction (under its savepoint once a member has failed), and a member
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
	// Enabled makes the QoS chain use group commit: "group-commit" in place of "transaction"
	// and "deduplicate", or, for AtLeastOnce and BestEffort, "group-transaction" in place of
	// "transaction"; with Dedup.ByOffset "group-offsets" in place of "transaction" and
	// "offsets", with Dedup.AckInTransaction "group-transaction" in place of "transaction".
	// Defaults to false. A handler with Interceptors names those interceptors
	// instead, and leaves Enabled false. Not supported with Dedup.CheckFirst.
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

// Validate reports the first invalid field of h, by name. It does not check Interceptors
// against the registered names; AddHandler does.
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
	case h.BatchProcessor != nil && (h.QoS == BestEffort || h.QoS == ExactlyOnceInOrder):
		return fmt.Errorf("Handler.BatchProcessor: not supported with %s (handler %q; use ExactlyOnce or AtLeastOnce)", h.QoS, h.Name)
	case h.BatchProcessor != nil && h.Dedup.CheckFirst:
		return fmt.Errorf("Handler.BatchProcessor: not supported with Dedup.CheckFirst (handler %q)", h.Name)
	case (len(h.Interceptors) == 0 || h.QoS != 0) && !h.QoS.Valid():
		return fmt.Errorf("Handler.QoS: %s is not a quality of service (handler %q; want BestEffort, AtLeastOnce, ExactlyOnce or ExactlyOnceInOrder)", h.QoS, h.Name)
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
	case h.Dedup.AckInTransaction && (h.QoS != ExactlyOnce || len(h.Interceptors) > 0):
		return fmt.Errorf("Handler.Dedup.AckInTransaction: applies to the ExactlyOnce chain (handler %q; with Interceptors set, name %q in the list instead)", h.Name, InterceptorAckInTransaction)
	case h.Dedup.AckInTransaction && (h.BatchProcessor != nil || h.Dedup.CheckFirst || h.Dedup.WithTimestamp || h.Dedup.ByOffset):
		return fmt.Errorf("Handler.Dedup.AckInTransaction: not supported with a batch processor, Dedup.CheckFirst, Dedup.WithTimestamp or Dedup.ByOffset (handler %q)", h.Name)
	case h.Dedup.ByOffset && (h.QoS != ExactlyOnce || len(h.Interceptors) > 0):
		return fmt.Errorf("Handler.Dedup.ByOffset: applies to the ExactlyOnce chain (handler %q; with Interceptors set, name %q in the list instead)", h.Name, InterceptorOffsets)
	case h.Dedup.ByOffset && (h.Dedup.CheckFirst || h.Dedup.WithTimestamp):
		return fmt.Errorf("Handler.Dedup.ByOffset: not supported with Dedup.CheckFirst or Dedup.WithTimestamp (handler %q)", h.Name)
	case h.Converter != nil && h.IDHeader != "":
		return fmt.Errorf("Handler.IDHeader: set together with Converter (handler %q; give the converter its IDHeader)", h.Name)
	case h.Dedup.Retention < 0:
		return fmt.Errorf("Handler.Dedup.Retention: %s is negative", h.Dedup.Retention)
	case h.GroupCommit.MaxSize < 0:
		return fmt.Errorf("Handler.GroupCommit.MaxSize: %d is negative", h.GroupCommit.MaxSize)
	case h.GroupCommit.MaxWait < 0:
		return fmt.Errorf("Handler.GroupCommit.MaxWait: %s is negative", h.GroupCommit.MaxWait)
	case h.GroupCommit.Enabled && len(h.Interceptors) > 0:
		return fmt.Errorf("Handler.GroupCommit.Enabled: applies to the QoS chain; with Interceptors set, name %q (or %q) in the list instead (handler %q)",
			InterceptorGroupCommit, InterceptorGroupTransaction, h.Name)
	case h.GroupCommit.Enabled && h.Dedup.CheckFirst:
		return errors.New("Handler.GroupCommit.Enabled: not supported with Dedup.CheckFirst (a group records its ids with one multi-row insert, without internal ids)")
	}
	if err := h.validateMiddlewares(); err != nil {
		return err
	}
	if h.Dedup.Table != "" {
		if err := sqldb.CheckIdentifier("Handler.Dedup.Table", h.Dedup.Table); err != nil {
			return err
		}
	}
	return h.Order.validate(h.Name)
}

// converter returns the handler's converter: Converter, or the default one for IDHeader, which
// logs to logger.
func (h Handler) converter(logger *slog.Logger) converter.MessageConverter {
	if h.Converter != nil {
		return h.Converter
	}
	return converter.New(converter.Config{IDHeader: h.IDHeader, Logger: logger})
}

// interceptor returns the interceptor that detects duplicates in the ExactlyOnce chain.
func (c DedupConfig) interceptor() string {
	switch {
	case c.ByOffset:
		return InterceptorOffsets
	case c.AckInTransaction:
		return InterceptorAckInTransaction
	}
	return InterceptorDeduplicate
}

// OrderConfig configures per-key ordering for a handler: the "in-order" interceptor of
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

// validateMiddlewares reports the first entry of h.Middlewares that cannot take its place in
// the chain: nil, a built-in's name, or a name that Interceptors does not list.
func (h Handler) validateMiddlewares() error {
	names := slices.Sorted(maps.Keys(h.Middlewares))
	for _, name := range names {
		switch _, builtin := builtinNamed(name); {
		case h.Middlewares[name] == nil:
			return fmt.Errorf("Handler.Middlewares: %q is nil (handler %q)", name, h.Name)
		case builtin:
			return fmt.Errorf("Handler.Middlewares: %q is the name of a built-in interceptor (handler %q)", name, h.Name)
		case !slices.Contains(h.Interceptors, name):
			return fmt.Errorf("Handler.Middlewares: %q is not listed in Interceptors (handler %q; the list says where each goes in the chain)", name, h.Name)
		}
	}
	return nil
}
