package groupcommit

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// Store is the duplicate-detection store of a group that records its members' ids: it records
// the keys of a whole group with one statement, and forgets the key of a member whose writes
// were rolled back. *dedup.SQLStore satisfies it.
type Store interface {
	// RecordMany records keys in tx and reports for each position whether it was newly
	// recorded; a key repeated in keys is new at most at its first position.
	RecordMany(ctx context.Context, tx sqlx.ExtContext, keys []dedup.Key) ([]bool, error)
	// Forget deletes key in tx.
	Forget(ctx context.Context, tx sqlx.ExtContext, key dedup.Key) error
}

var _ Store = (*dedup.SQLStore)(nil)

// DefaultMaxSize is the most members of one group of a Config whose MaxSize is zero.
const DefaultMaxSize = 64

// errCopyFailed reports an in-group copy of a message whose first copy in the same group was
// not committed: the copy is retried rather than taken for a duplicate.
var errCopyFailed = errors.New("another copy of this message in the same group was not committed")

// savepointName is the savepoint set before each member once a member of its group has failed;
// PostgreSQL, MySQL, MariaDB and SQLite share the syntax. Every member reuses the name and none
// is released, which saves a round trip per member: PostgreSQL and SQLite nest a savepoint
// inside the one of the same name before it, MySQL replaces that one, and either way ROLLBACK
// TO SAVEPOINT returns to the newest, the failing member's own. COMMIT ends them all.
const savepointName = "onceflow_member"

// groupConfig is a Config with its defaults set.
type groupConfig struct {
	Config
	maxSize, concurrency int
}

// Config configures a group transaction (New).
type Config struct {
	// DB begins the groups' transactions, with Isolation. Required.
	DB        middleware.Beginner
	Isolation sql.IsolationLevel
	// MaxSize is the most messages one group holds; a full group starts as soon as a
	// transaction may. Defaults to DefaultMaxSize. 1 turns grouping off: every message has a
	// transaction of its own.
	MaxSize int
	// MaxWait is how long a group that is not full waits for more members after its first one
	// joined, when a transaction could start at once. Defaults to 0: it starts at once. A group
	// never waits for a transaction to be free longer than that takes: while every transaction
	// is busy, the messages that arrive form the next group, which starts as soon as one is free.
	MaxWait time.Duration
	// Concurrency is how many groups may have their transactions running at once, each on a
	// connection of its own: while some commit, the next ones collect their members. Defaults
	// to 1.
	Concurrency int
	// Batch, when set, is handed the group's new messages in one call, instead of the rest of
	// the chain running for each: its ProcessBatch runs in the group's transaction and may
	// write all of them with one statement. The middleware then ignores the processor it
	// wraps; nothing may stand between it and the processor in the chain.
	Batch processor.Batch

	// Store, when set, records the ids of the group's members for Handler, in the group's
	// transaction: duplicate detection by id (insert-first), with the message timestamp in the
	// key WithTimestamp, and BeyondRetention for a message delivered beyond the store's
	// retention, reported to ReportBeyond first.
	Store           Store
	Handler         string
	WithTimestamp   bool
	BeyondRetention dedup.RetentionPolicy
	ReportBeyond    func(ctx context.Context, msg *messagedata.MessageData, reason string)
	// Positions, when set instead, detects duplicates by position for Handler (see the doc of
	// New).
	Positions *dedup.Positions

	// Committed is called after each group transaction that commits, in the group's
	// goroutine, with the number of messages whose effects it committed (the members that
	// succeeded; a duplicate or a failed member is not one).
	Committed func(ctx context.Context, messages int)
	// joined, for tests, is called after a member joined an open group, with the group's size
	// then.
	joined func(size int)
}

// New returns the middleware of cfg. It processes concurrent deliveries in groups that share
// one database transaction, and, with cfg.Store, records their message ids for cfg.Handler in
// that transaction: the exactly-once work of the transaction and deduplicate stages, with one
// commit for many messages. Retry stays outside it, so each attempt of a message joins a group
// of its own. Without cfg.Store nor cfg.Positions it records nothing (a group transaction of
// an at-least-once chain, or one whose duplicate detection runs member by member inside it).
//
// Each message joins the open group and waits. Up to cfg.Concurrency groups run at once; a
// group starts when a transaction may start and it is full, or its MaxWait has passed (at
// once by default). While every transaction is busy, arriving messages collect in the next
// group, up to MaxSize, so groups grow with the load. A group's transaction:
//
//  1. records the ids of all members with one multi-row statement (Store.RecordMany);
//     a member whose id is recorded already is a duplicate and is not processed;
//  2. runs the rest of the chain for each new member in turn, in the order they joined (or,
//     with cfg.Batch, hands all of them to the batch processor in one call);
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
// With cfg.Positions, duplicates are detected by position instead (GroupOffsets, in
// groupoffsets.go). New returns an error for a Config out of range, or with both Store and
// Positions.
func New(cfg Config) (middleware.Middleware, error) {
	switch {
	case cfg.DB == nil:
		return nil, errors.New("groupcommit: DB is nil")
	case cfg.MaxSize < 0:
		return nil, fmt.Errorf("groupcommit: MaxSize: %d is negative", cfg.MaxSize)
	case cfg.MaxWait < 0:
		return nil, fmt.Errorf("groupcommit: MaxWait: %s is negative", cfg.MaxWait)
	case cfg.Concurrency < 0:
		return nil, fmt.Errorf("groupcommit: Concurrency: %d is negative", cfg.Concurrency)
	case cfg.Store != nil && cfg.Positions != nil:
		return nil, errors.New("groupcommit: Store and Positions are both set (a group detects duplicates one way)")
	case !cfg.BeyondRetention.Valid():
		return nil, fmt.Errorf("groupcommit: BeyondRetention: %s is not a retention policy", cfg.BeyondRetention)
	}
	g := groupConfig{Config: cfg, maxSize: cmp.Or(cfg.MaxSize, DefaultMaxSize), concurrency: max(cfg.Concurrency, 1)}
	var txOpts *sql.TxOptions
	if cfg.Isolation != 0 {
		txOpts = &sql.TxOptions{Isolation: cfg.Isolation}
	}
	lanes := 1
	if cfg.Positions != nil {
		lanes = g.concurrency
	}
	var retention time.Duration
	if s, ok := cfg.Store.(interface{ Retention() time.Duration }); ok {
		retention = s.Retention()
	}
	return func(next processor.Processor) processor.Processor {
		return &grouper{db: cfg.DB, store: cfg.Store, positions: cfg.Positions, handler: cfg.Handler, cfg: g, txOpts: txOpts,
			next: next, retention: retention, opens: make([]*group, lanes)}
	}, nil
}
