package onceflow

import (
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

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

	// Processor applies each message's effect. Required.
	Processor processor.Processor

	// QoS selects the canonical chain of interceptors for the quality of service. Required
	// unless Interceptors is set. With Interceptors set, QoS only decides when the message is
	// acknowledged: BestEffort acks on receipt, every other level after the chain.
	QoS QoS

	// Interceptors, when set, replaces the QoS chain with interceptors named here, outermost
	// first (seed 002's interceptorNames). The built-in names are listed in Interceptor*
	// constants; Router.RegisterInterceptor adds custom ones. "deduplicate" must come after
	// "transaction", and "retry" before it; "group-commit" replaces both "transaction" and
	// "deduplicate", with "retry" before it.
	Interceptors []string

	// DB is the database the processor writes to, in whose transaction the message id is
	// recorded. Required by every built-in chain.
	DB *sqldb.DB

	// Concurrency is how many messages of this handler are processed at once, as that many
	// subscriptions to Topic. Defaults to 1. Brokers that serialise a consumer group (the SQL
	// queues) deliver one message at a time whatever the value.
	Concurrency int

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

	// MessagingSystem is the messaging.system attribute of the handler's spans, such as
	// "rabbitmq". Defaults to "onceflow".
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

	// WithTimestamp makes the message timestamp part of the key (seed 002's message_log).
	WithTimestamp bool

	// CheckFirst selects seed 003's check-first id mapping: look the id up before writing,
	// mint an internal time-ordered id for new messages (processor.InternalID).
	CheckFirst bool

	// Store replaces the SQL store built from DB and Table, for tests and benchmarks.
	Store dedup.Store
}

// GroupCommitConfig configures group commit for a handler (see middleware.GroupCommit). Up to
// Concurrency deliveries are processed in one transaction, each under its own savepoint, so
// that a failing message rolls back alone; their ids are recorded with one statement, and each
// message is acknowledged only after the one commit. It pays off when the commit dominates the
// processing time of a message; it loses when the processor waits on something else (a remote
// call, a slow query), since a group's messages run one after the other on one connection.
type GroupCommitConfig struct {
	// Enabled makes the QoS chain use group commit: "group-commit" in place of "transaction"
	// and "deduplicate", or, for AtLeastOnce and BestEffort, "group-transaction" in place of
	// "transaction". Defaults to false. A handler with Interceptors names those interceptors
	// instead, and leaves Enabled false. Not supported with Dedup.CheckFirst.
	Enabled bool

	// MaxSize is the most messages in one group. Defaults to middleware.DefaultMaxGroupSize
	// (64). A group never holds more than Concurrency messages.
	MaxSize int

	// MaxWait is the longest a group waits for more messages after its first one. Defaults to
	// middleware.DefaultMaxGroupWait (5 ms). A group starts before that when no other group of
	// the handler is running and every delivery in flight (at most Concurrency) has joined it.
	MaxWait time.Duration
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
	case h.Processor == nil:
		return fmt.Errorf("Handler.Processor: nil (handler %q)", h.Name)
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
	if h.Dedup.Table != "" {
		if err := sqldb.CheckIdentifier("Handler.Dedup.Table", h.Dedup.Table); err != nil {
			return err
		}
	}
	return h.Order.validate(h.Name)
}
