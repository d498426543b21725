package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/oklog/ulid/v2"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// errOutsideTransaction is the error of a middleware that runs outside Transaction.
var errOutsideTransaction = fmt.Errorf("%w: place this middleware inside Transaction", ErrNoTransaction)

// DedupMode is how the deduplicate stage tells a message it applied before.
type DedupMode int

// The dedup modes.
const (
	// DedupInsertFirst records the message id in the dedup table, first thing in the
	// transaction, with the business writes (a classic message_log table): a conflict means a
	// duplicate. The default.
	DedupInsertFirst DedupMode = iota
	// DedupCheckFirst is an id mapper's way: the id is looked up first, so a redelivery costs
	// one read and no write lock, and a new message gets an internal, time-ordered id
	// (processor.InternalID) recorded with it as the id mapping, whose expiry is the table's
	// retention. Concurrent copies are still caught by the insert that follows the check.
	DedupCheckFirst
	// DedupByOffset detects duplicates by position instead of by id, for brokers that deliver
	// each partition of a topic in order (Kafka): the handler's last applied offset in each
	// partition (dedup.DefaultPositionsTable) is locked and updated in the transaction, and a
	// message at or below it is a duplicate. No row is written per message, so nothing needs
	// purging, and a message needs no id; it needs a position (messagedata.PositionOf), or it
	// is refused with a permanent error. A message whose predecessor in its partition is not
	// applied yet fails retryably (ErrPositionAhead), so that no offset is skipped.
	DedupByOffset
	// DedupAckInTransaction acknowledges the message inside the transaction instead of
	// recording its id, for a queue that lives in the handler's database (the PostgreSQL and
	// MySQL queues of package broker/sqlqueue): the acknowledgement commits with the business
	// writes or rolls back with them, so the message is consumed exactly when its effect
	// commits, with no dedup row at all. When the queue says the delivery is no longer its own
	// (its lease passed and another consumer holds the message), nothing is processed and the
	// message is a duplicate: the other consumer applies it.
	DedupAckInTransaction
	// DedupNatural is natural idempotency, without a dedup table: a unique violation of one of
	// UniqueConstraints from the processor means the row this message inserts exists, so the
	// message was applied before, and it is a duplicate. A unique violation of any other
	// constraint is a conflict with a different row: it stays an error, which the default
	// classifier makes permanent. For a version- or state-checked UPDATE that touches no row,
	// the processor decides itself, with processor.CheckVersion. The violating statement has
	// spoilt the transaction (on PostgreSQL it is aborted), which is rolled back.
	DedupNatural
)

var dedupModes = map[DedupMode]string{
	DedupInsertFirst: "DedupInsertFirst", DedupCheckFirst: "DedupCheckFirst", DedupByOffset: "DedupByOffset",
	DedupAckInTransaction: "DedupAckInTransaction", DedupNatural: "DedupNatural",
}

// String returns the name of m, such as "DedupByOffset".
func (m DedupMode) String() string {
	if s, ok := dedupModes[m]; ok {
		return s
	}
	return fmt.Sprintf("DedupMode(%d)", int(m))
}

// RecordsIDs reports whether m records message ids in a dedup table (DedupInsertFirst,
// DedupCheckFirst).
func (m DedupMode) RecordsIDs() bool { return m == DedupInsertFirst || m == DedupCheckFirst }

// Dedup configures the deduplicate stage: duplicate detection in the transaction, by Mode. It
// must run inside the transaction: what it records commits with the processor's writes, or
// rolls back with them, so a failed attempt leaves no record and its redelivery is processed.
// For a duplicate the stage returns an error wrapping processor.ErrDuplicate, and the router
// acks. The zero value is the default configuration: insert-first into dedup.DefaultTable.
//
// By id (DedupInsertFirst, DedupCheckFirst), a message without an id is refused with a
// permanent error wrapping messagedata.ErrNoMessageID, so it is dead-lettered instead of
// processed under an empty key. Two copies of one message processed at the same time by two
// consumers give one effect: the second insert of the key waits for the first transaction,
// then finds the key and reports a duplicate. A message delivered beyond the table's retention
// (its expired key still recorded, or its timestamp older than the retention) is handled by
// BeyondRetention.
type Dedup struct {
	// Mode is how duplicates are detected. Defaults to DedupInsertFirst.
	Mode DedupMode

	// Table is the table that records processed message ids (DedupInsertFirst,
	// DedupCheckFirst). Defaults to dedup.DefaultTable. Handlers may share a table: the handler
	// name is part of the key.
	Table string

	// Retention is how long a message id is remembered (DedupInsertFirst, DedupCheckFirst).
	// Defaults to dedup.DefaultRetention. It must outlive the longest time the broker may take
	// to redeliver a message.
	Retention time.Duration

	// WithTimestamp makes the message timestamp part of the key, as a classic message_log table
	// does with the JMS timestamp: ids that a producer reuses over time stay distinct
	// (DedupInsertFirst, DedupCheckFirst).
	WithTimestamp bool

	// BeyondRetention is what happens to a message delivered beyond Retention: its expired key
	// still recorded (a certain duplicate), or its timestamp older than Retention. Each is
	// reported (the router counts it in onceflow.dedup.beyond_retention and logs it at WARN),
	// then handled by the policy. Defaults to dedup.DeadLetterExpiredKeys: dead-letter the
	// certain duplicates, process the old messages.
	BeyondRetention dedup.RetentionPolicy

	// UniqueConstraints names the unique constraints whose violation DedupNatural takes for an
	// earlier delivery of the message (sqldb.UniqueConstraint says how each database names
	// them: the constraint or index name on PostgreSQL, the key name on MySQL and MariaDB,
	// "table.column" on SQLite). Required by DedupNatural, and only read by it.
	UniqueConstraints []string

	// Store replaces the SQL store of Table (DedupInsertFirst, DedupCheckFirst), for tests and
	// benchmarks; the router also passes its own here, one per database and table.
	Store dedup.Store
}

// Validate reports the first invalid field of d, by name: a value out of range, or a field
// that d's Mode does not read.
func (d Dedup) Validate() error {
	table := d.Mode.RecordsIDs()
	switch {
	case dedupModes[d.Mode] == "":
		return fmt.Errorf("Mode: %s is not a dedup mode", d.Mode)
	case d.Retention < 0:
		return fmt.Errorf("Retention: %s is negative", d.Retention)
	case !d.BeyondRetention.Valid():
		return fmt.Errorf("BeyondRetention: %s is not a retention policy", d.BeyondRetention)
	case d.Mode == DedupNatural && len(d.UniqueConstraints) == 0:
		return errors.New("UniqueConstraints: empty (DedupNatural takes a unique violation for an earlier delivery of the message only on the constraints named here; any other is a conflict with another row)")
	case d.Mode != DedupNatural && len(d.UniqueConstraints) > 0:
		return fmt.Errorf("UniqueConstraints: set, but %s does not read it (only DedupNatural does)", d.Mode)
	case !table && d.Table != "":
		return fmt.Errorf("Table: set, but %s keeps no dedup table", d.Mode)
	case !table && d.Retention != 0:
		return fmt.Errorf("Retention: set, but %s keeps no dedup table", d.Mode)
	case !table && d.WithTimestamp:
		return fmt.Errorf("WithTimestamp: set, but %s keeps no dedup table", d.Mode)
	case !table && d.BeyondRetention != 0:
		return fmt.Errorf("BeyondRetention: set, but %s keeps no dedup table", d.Mode)
	case !table && d.Store != nil:
		return fmt.Errorf("Store: set, but %s keeps no dedup table", d.Mode)
	}
	if d.Table != "" {
		if err := sqldb.CheckIdentifier("Table", d.Table); err != nil {
			return err
		}
	}
	return nil
}

// Middleware returns the deduplicate stage of d for handler, on the database db: its Store, or
// for DedupInsertFirst and DedupCheckFirst the SQL store of Table on db (created by the
// store's Migrate), and for DedupByOffset the positions table of db (dedup.Positions.Migrate).
// It fails, naming the field, when d is not valid, and when db is nil where d needs it.
func (d Dedup) Middleware(db *sqldb.DB, handler string) (Middleware, error) {
	if err := d.Validate(); err != nil {
		return nil, fmt.Errorf("Dedup.%w", err)
	}
	switch d.Mode {
	case DedupAckInTransaction:
		return ackInTransaction(), nil
	case DedupNatural:
		return naturalIdempotency(d.UniqueConstraints), nil
	case DedupByOffset:
		if db == nil {
			return nil, errors.New("Dedup: the database is nil (DedupByOffset keeps its positions there)")
		}
		p, err := dedup.NewPositions(db, dedup.PositionsConfig{})
		if err != nil {
			return nil, err
		}
		return offsets(p, handler), nil
	}
	store := d.Store
	if store == nil {
		if db == nil {
			return nil, errors.New("Dedup: the database and Store are nil (set one of them)")
		}
		s, err := dedup.New(db, dedup.Config{Table: d.Table, Retention: d.Retention})
		if err != nil {
			return nil, fmt.Errorf("Dedup: %w", err)
		}
		store = s
	}
	return d.byID(store, handler), nil
}

// byID returns the duplicate detection by id of d in store, for handler.
func (d Dedup) byID(store dedup.Store, handler string) Middleware {
	retention := time.Duration(0)
	if s, ok := store.(interface{ Retention() time.Duration }); ok {
		retention = s.Retention()
	}
	recorder, renewals := store.(interface {
		RecordKey(ctx context.Context, tx sqlx.ExtContext, key dedup.Key, internalID string) (dedup.Outcome, error)
	})
	checkFirst := d.Mode == DedupCheckFirst
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if msg.ID == "" {
				return processor.Permanent(messagedata.ErrNoMessageID)
			}
			tx, ok := CurrentTx(ctx)
			if !ok {
				return errOutsideTransaction
			}
			key := dedup.KeyOf(handler, msg, d.WithTimestamp)
			dctx, end := telemetry.Child(ctx, telemetry.SpanDedup)
			internalID := ""
			if checkFirst {
				existing, found, err := store.Lookup(dctx, tx, key)
				if err != nil {
					end(err)
					return invalidKeyIsPermanent(fmt.Errorf("look up message %q: %w", msg.ID, err))
				}
				if found {
					end(nil)
					return fmt.Errorf("%w: id %q is mapped to %q", processor.ErrDuplicate, msg.ID, existing)
				}
				// Monotonic within a millisecond as well: ids minted by one process sort in
				// the order they were minted.
				internalID = ulid.Make().String()
			}
			var outcome dedup.Outcome
			var err error
			if renewals {
				outcome, err = recorder.RecordKey(dctx, tx, key, internalID)
			} else {
				var fresh bool
				fresh, err = store.Record(dctx, tx, key, internalID)
				if fresh {
					outcome = dedup.Recorded
				}
			}
			end(err)
			if err != nil {
				return invalidKeyIsPermanent(fmt.Errorf("record message %q: %w", msg.ID, err))
			}
			if !outcome.New() {
				return fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, msg.ID, handler)
			}
			reason, err := d.BeyondRetention.Check(msg, outcome, retention)
			if reason != "" {
				if st := delivery.From(ctx); st != nil && st.Records != nil && st.Records.BeyondRetention != nil {
					st.Records.BeyondRetention(ctx, msg, reason)
				}
			}
			if err != nil {
				return err // the transaction rolls back: the expired record stays as it was
			}
			if checkFirst {
				ctx = WithInternalID(ctx, internalID)
			}
			return next.Process(ctx, msg)
		})
	}
}

// invalidKeyIsPermanent marks an id the store cannot hold (too long, not UTF-8) as permanent:
// redelivering the message cannot change its id.
func invalidKeyIsPermanent(err error) error {
	if errors.Is(err, dedup.ErrInvalidKey) {
		return processor.Permanent(err)
	}
	return err
}
