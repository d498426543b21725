package dedup

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/internal/sqllock"
	"github.com/onceflow/onceflow/sqldb"
)

// This file keeps the dedup table bounded: Purge deletes the expired keys in bounded batches,
// one Purge of the table at a time, and Stats reports what the table holds.

// PurgeOptions bounds a Purge: rows per DELETE and DELETEs per purge.
type PurgeOptions = sqldb.PurgeOptions

// PurgeResult says what one Purge did.
type PurgeResult = sqldb.PurgeResult

// DefaultPurgeBatchSize is the batch size of a Purge whose BatchSize is zero.
const DefaultPurgeBatchSize = sqldb.DefaultPurgeBatchSize

// purgeLockName names the lock that one Purge of the table holds at a time.
func (s *SQLStore) purgeLockName() string { return s.table + ".purge" }

// Purge deletes expired keys in batches of BatchSize, each its own statement outside any
// transaction, until a batch deletes fewer than BatchSize rows, MaxBatches batches have run,
// or ctx ends. It deletes exactly the rows that Record and Lookup treat as expired at the
// moment Purge starts, and never a row that a concurrent Record has renewed.
//
// One purge per table runs at a time across all processes: PostgreSQL uses a session advisory
// lock, MySQL and MariaDB a named lock (GET_LOCK), SQLite an flock on the file
// "<database file>.<table>.purge.lock" beside the database. When another purge holds the lock,
// Purge returns at once with Skipped set and a nil error. On error, the result counts what was
// deleted before it.
func (s *SQLStore) Purge(ctx context.Context, opts PurgeOptions) (res PurgeResult, err error) {
	if err := opts.Validate(); err != nil {
		return res, fmt.Errorf("dedup: Purge: %w", err)
	}
	release, held, err := sqllock.TryLock(ctx, s.db, s.purgeLockName())
	if err != nil {
		return res, fmt.Errorf("dedup: purge %s: take the purge lock: %w", s.table, err)
	}
	if !held {
		return PurgeResult{Skipped: true}, nil
	}
	defer func() {
		if rerr := release(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("dedup: purge %s: release the purge lock: %w", s.table, rerr))
		}
	}()

	now := s.now().UnixMicro()
	res, err = sqldb.PurgeBatches(ctx, opts, func(ctx context.Context, batch int) (int64, error) {
		return s.db.PurgeExec(ctx, s.q.purge, now, batch)
	})
	if err != nil {
		return res, fmt.Errorf("dedup: purge %s: %w", s.table, err)
	}
	return res, nil
}

// Stats describes the contents of the table, for observability gauges.
type Stats struct {
	// Rows is the number of rows, expired ones included.
	Rows int64
	// Expired is the number of rows whose retention has passed and that Purge would delete.
	// A value that keeps growing means purging does not keep up.
	Expired int64
	// Oldest is the time the oldest row was recorded, zero when the table is empty.
	Oldest time.Time
}

// Stats counts the rows of the table. It reads the whole table in one statement: on a large
// table, call it at the pace of a metrics scrape, not per message.
func (s *SQLStore) Stats(ctx context.Context) (Stats, error) {
	var st Stats
	var oldest int64
	if err := s.db.QueryRowxContext(ctx, s.q.stats, s.now().UnixMicro()).Scan(&st.Rows, &oldest, &st.Expired); err != nil {
		return Stats{}, fmt.Errorf("dedup: stats of %s: %w", s.table, err)
	}
	if st.Rows > 0 {
		st.Oldest = time.UnixMicro(oldest)
	}
	return st, nil
}
