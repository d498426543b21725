package middleware

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/attribute"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/processor"
)

// GroupStore is the duplicate-detection store of GroupCommit: it records the keys of a whole
// group with one statement, and forgets the key of a member whose writes were rolled back.
// *dedup.SQLStore satisfies it.
type GroupStore interface {
	// RecordMany records keys in tx and reports for each position whether it was newly
	// recorded; a key repeated in keys is new at most at its first position.
	RecordMany(ctx context.Context, tx sqlx.ExtContext, keys []dedup.Key) ([]bool, error)
	// Forget deletes key in tx.
	Forget(ctx context.Context, tx sqlx.ExtContext, key dedup.Key) error
}

var _ GroupStore = (*dedup.SQLStore)(nil)

// Group commit defaults.
const (
	// DefaultMaxGroupSize is the most members of one group.
	DefaultMaxGroupSize = 64
	// DefaultMaxGroupWait is how long a group waits for more members after its first when a
	// transaction could start at once: none. Messages that arrive while the handler's
	// transactions are busy form the next group by themselves, so groups grow with the load
	// and a message arriving at a quiet moment is not held back.
	DefaultMaxGroupWait time.Duration = 0
)

// AttrGroupSize is the number of members of the group whose transaction committed a message,
// on its onceflow.commit span.
const AttrGroupSize = attribute.Key("onceflow.group.size")

// ErrGroupAborted reports a member of a group whose own processing succeeded, or never ran,
// but whose group's transaction was rolled back: a statement of the group itself failed (BEGIN,
// the id insert, a savepoint, the connection was lost, ...). Nothing of the member was
// committed; the error is retryable.
var ErrGroupAborted = errors.New("group transaction rolled back")

// errCopyFailed reports an in-group copy of a message whose first copy in the same group was
// not committed: the copy is retried rather than taken for a duplicate.
var errCopyFailed = errors.New("another copy of this message in the same group was not committed")

// savepointName is the savepoint set before each member once a member of its group has failed;
// PostgreSQL, MySQL, MariaDB and SQLite share the syntax. Every member reuses the name and none
// is released, which saves a round trip per member: PostgreSQL and SQLite nest a savepoint
// inside the one of the same name before it, MySQL replaces that one, and either way ROLLBACK
// TO SAVEPOINT returns to the newest, the failing member's own. COMMIT ends them all.
const savepointName = "onceflow_member"

// GroupOption configures GroupCommit and GroupTransaction. Besides the options below,
// WithIsolation sets the isolation level of the group's transaction, and WithTimestampKey
// makes GroupCommit's keys include the message timestamp, as they do for Deduplicate.
type GroupOption interface{ applyGroup(*groupConfig) }

type groupOptionFunc func(*groupConfig)

func (f groupOptionFunc) applyGroup(c *groupConfig) { f(c) }

// WithMaxGroupSize sets the most messages one group holds; a full group starts as soon as a
// transaction may. Defaults to DefaultMaxGroupSize. 1 turns grouping off: every message has a
// transaction of its own.
func WithMaxGroupSize(n int) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.maxSize = n })
}

// WithMaxWait sets how long a group that is not full waits for more members after its first
// one joined, when a transaction could start at once. Defaults to DefaultMaxGroupWait (0: it
// starts at once). A group never waits for a transaction to be free longer than that takes:
// while every transaction is busy, the messages that arrive form the next group, which starts
// as soon as one is free.
func WithMaxWait(d time.Duration) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.maxWait = d })
}

// WithConcurrency sets how many groups may have their transactions running at once, each on a
// connection of its own: while some commit, the next ones collect their members. The router
// passes Handler.Concurrency. Defaults to 1.
func WithConcurrency(n int) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.concurrency = n })
}

// WithBatch makes the group hand its new messages to b in one call, instead of running the
// rest of the chain for each: b's ProcessBatch runs in the group's transaction and may write
// all of them with one statement. The middleware then ignores the processor it wraps; nothing
// may stand between it and the processor in the chain. processor.Batch documents what b's
// result does to each message.
func WithBatch(b processor.Batch) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.batch = b })
}

// WithCommitted calls fn after each group transaction that commits, in the group's goroutine,
// with the number of messages whose effects it committed (the members that succeeded; a
// duplicate or a failed member is not one). The router records it as the group-size histogram
// (onceflow.group.size).
func WithCommitted(fn func(ctx context.Context, messages int)) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.committed = fn })
}

type groupConfig struct {
	maxSize      int
	maxWait      time.Duration
	concurrency  int
	txOpts       sql.TxOptions
	dedup        dedupConfig
	dedupOptions bool
	batch        processor.Batch
	committed    func(ctx context.Context, messages int)
	hooks        groupHooks
}

// groupHooks let tests observe the grouping; every field may be nil.
type groupHooks struct {
	// joined is called after a member joined an open group, with the group's size then.
	joined func(size int)
}

func newGroupConfig(opts []GroupOption) (groupConfig, error) {
	cfg := groupConfig{maxSize: DefaultMaxGroupSize, maxWait: DefaultMaxGroupWait, concurrency: 1}
	for _, o := range opts {
		o.applyGroup(&cfg)
	}
	switch {
	case cfg.maxSize < 1:
		return cfg, fmt.Errorf("WithMaxGroupSize: %d is not a group size (want at least 1)", cfg.maxSize)
	case cfg.maxWait < 0:
		return cfg, fmt.Errorf("WithMaxWait: %s is negative", cfg.maxWait)
	case cfg.concurrency < 0:
		return cfg, fmt.Errorf("WithConcurrency: %d is negative", cfg.concurrency)
	case cfg.dedup.checkFirst:
		return cfg, errors.New("CheckFirst: not supported by group commit (a group records its keys with one multi-row insert, without internal ids)")
	}
	if err := cfg.dedup.validate(); err != nil {
		return cfg, err
	}
	cfg.concurrency = max(cfg.concurrency, 1)
	return cfg, nil
}

// GroupCommit processes concurrent deliveries in groups that share one database transaction,
// and records their message ids for handler in store in that transaction: the exactly-once
// work of Transaction and Deduplicate, with one commit for many messages. It replaces both in
// a chain; Retry stays outside it, so each attempt of a message joins a group of its own.
//
// Each message joins the open group and waits. Up to WithConcurrency groups run at once; a
// group starts when a transaction may start and it is full, or its MaxWait has passed (at
// once by default). While every transaction is busy, arriving messages collect in the next
// group, up to MaxSize, so groups grow with the load. A group's transaction:
//
//  1. records the ids of all members with one multi-row statement (GroupStore.RecordMany);
//     a member whose id is recorded already is a duplicate and is not processed;
//  2. runs the rest of the chain for each new member in turn, in the order they joined (or,
//     with WithBatch, hands all of them to the batch processor in one call);
//  3. commits once.
//
// Nothing is paid per member for isolating failures on the way to a commit that succeeds.
// When a member fails (an error or a panic of its own), the transaction is rolled back and the
// group runs again without it, each remaining member then under a SAVEPOINT of its own, so
// that a further failure rolls back alone. A batch that fails names its failing messages
// (processor.ErrorFor) and runs again without them, or, when it names none, is split in halves
// that run on their own until the failing messages are found; a lost connection, a
// serialization failure or a deadlock fails the whole group retryably instead.
//
// Each message then gets its own outcome, as Transaction and Deduplicate would give it, and
// only after the outcome of the transaction that holds its effect is known: nil once that
// commit succeeded (the router acks); its own error or panic, re-raised in its own goroutine;
// an error wrapping processor.ErrDuplicate for a duplicate. When a statement of the group
// itself fails (BEGIN, the id insert, a savepoint, COMMIT) every member gets an error, which
// wraps ErrCommitOutcomeUnknown when the connection was lost during COMMIT and ErrGroupAborted
// for a member whose own processing had succeeded: none is acknowledged, and each is retried.
// A message without an id is refused with a permanent error wrapping
// messagedata.ErrNoMessageID, before it joins a group.
//
// A processor may thus run more than once for one message within one delivery: its database
// writes commit exactly once; effects outside the database must tolerate a repeat, as they must
// for Retry.
//
// Contexts: the group's own statements (BEGIN, the id insert, savepoints, COMMIT) run under a
// context that no single member ends; it ends only when every member's context has ended, and
// then the transaction rolls back. A member whose context ends while it waits for its group
// to start, or for its turn, leaves the group and returns the context's error; the rest of the
// chain and the processor run under the member's own context. The drivers close the connection
// of a statement whose context ends while it runs, so a member that times out inside a
// statement makes its whole group fail and retry.
//
// The members of a group run one after the other on one connection: group commit pays off
// when the commit dominates the time of a message, and loses when the processor spends its
// time elsewhere (a remote call, a long query), which per-message transactions run in
// parallel. A group also holds the locks of all its members until it commits.
//
// It returns an error for an invalid option, or for CheckFirst, which group commit does not
// support.
func GroupCommit(db Beginner, store GroupStore, handler string, opts ...GroupOption) (Middleware, error) {
	if store == nil {
		return nil, errors.New("GroupCommit: store is nil (use GroupTransaction to group transactions without duplicate detection)")
	}
	cfg, err := newGroupConfig(opts)
	if err != nil {
		return nil, fmt.Errorf("GroupCommit: %w", err)
	}
	return groupMiddleware(db, store, handler, cfg), nil
}

// GroupTransaction is GroupCommit without duplicate detection: concurrent deliveries share one
// transaction and each is acknowledged after the one commit. It replaces Transaction in an
// at-least-once chain. It returns an error for an invalid option, or for a Deduplicate option.
func GroupTransaction(db Beginner, opts ...GroupOption) (Middleware, error) {
	cfg, err := newGroupConfig(opts)
	if err == nil && cfg.dedupOptions {
		err = errors.New("a duplicate-detection option was given, but GroupTransaction records no message ids (use GroupCommit)")
	}
	if err != nil {
		return nil, fmt.Errorf("GroupTransaction: %w", err)
	}
	return groupMiddleware(db, nil, "", cfg), nil
}

// txOptions returns the options of a group's transactions, nil for the database's defaults.
func txOptions(cfg groupConfig) *sql.TxOptions {
	if cfg.txOpts == (sql.TxOptions{}) {
		return nil
	}
	return &cfg.txOpts
}

func groupMiddleware(db Beginner, store GroupStore, handler string, cfg groupConfig) Middleware {
	txOpts := txOptions(cfg)
	return func(next processor.Processor) processor.Processor {
		return &grouper{db: db, store: store, handler: handler, cfg: cfg, txOpts: txOpts, next: next, retention: retentionOf(store),
			opens: make([]*group, 1)}
	}
}
