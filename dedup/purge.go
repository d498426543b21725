package dedup

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/internal/sqllock"
	"github.com/onceflow/onceflow/sqldb"
)

// This file keeps the dedup table bounded: Purge deletes the expired keys in bounded batches,
// one Purge of the table at a time, and records what it did (LastPurge); Stats reports what
// the table holds.

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

	start := s.now()
	now := start.UnixMicro()
	res, err = sqldb.PurgeBatches(ctx, opts, func(ctx context.Context, batch int) (int64, error) {
		return s.db.PurgeExec(ctx, s.q.purge, now, batch)
	})
	if err != nil {
		return res, fmt.Errorf("dedup: purge %s: %w", s.table, err)
	}
	if err := s.recordPurge(ctx, PurgeRecord{At: start, Deleted: res.Deleted, Batches: res.Batches, Took: s.now().Sub(start)}); err != nil {
		return res, fmt.Errorf("dedup: purge %s: %d keys purged, but the purge was not recorded in %s (onceflow migrate creates it): %w",
			s.table, res.Deleted, purgesTable(s.table), err)
	}
	return res, nil
}

// PurgeRecord is what the last Purge of a table did, as LastPurge reads it.
type PurgeRecord struct {
	// At is when the purge started; zero when the table was never purged.
	At time.Time
	// Deleted is how many expired keys it deleted, in Batches statements.
	Deleted int64
	Batches int
	// Took is how long it ran.
	Took time.Duration
}

// purgesTable returns the name of the one-row table that records the last purge of table.
func purgesTable(table string) string { return besideTable(table, "_purges") }

// migratePurges creates the table that records the last purge, if it does not exist.
func (s *SQLStore) migratePurges(ctx context.Context) error {
	return createSmallTable(ctx, s.db, purgesTable(s.table), func(string) string {
		return `id        INTEGER NOT NULL PRIMARY KEY,
	purged_at BIGINT NOT NULL,
	deleted   BIGINT NOT NULL,
	batches   INTEGER NOT NULL,
	took_us   BIGINT NOT NULL`
	})
}

// recordPurge writes rec as the last purge of the table. Every Purge that ran (that was not
// skipped) writes it, after its deletes; it is one row, so it costs nothing to keep.
func (s *SQLStore) recordPurge(ctx context.Context, rec PurgeRecord) error {
	t := s.db.Dialect.Quote(purgesTable(s.table))
	stmt := `INSERT INTO ` + t + ` (id, purged_at, deleted, batches, took_us) VALUES (1, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET purged_at = EXCLUDED.purged_at, deleted = EXCLUDED.deleted, batches = EXCLUDED.batches, took_us = EXCLUDED.took_us`
	if s.db.Dialect == sqldb.MySQL {
		stmt = `INSERT INTO ` + t + ` (id, purged_at, deleted, batches, took_us) VALUES (1, ?, ?, ?, ?)
ON DUPLICATE KEY UPDATE purged_at = VALUES(purged_at), deleted = VALUES(deleted), batches = VALUES(batches), took_us = VALUES(took_us)`
	}
	_, err := s.db.ExecContext(ctx, s.db.Rebind(stmt), rec.At.UnixMicro(), rec.Deleted, rec.Batches, rec.Took.Microseconds())
	return err
}

// LastPurge returns what the last Purge of the table did, whichever process ran it: the
// router's purge loop or onceflow purge. The record is zero when the table was never purged,
// or its database has no record table yet (Migrate creates it).
func (s *SQLStore) LastPurge(ctx context.Context) (PurgeRecord, error) {
	name := purgesTable(s.table)
	exists, err := s.db.TableExists(ctx, name)
	if err != nil || !exists {
		return PurgeRecord{}, err
	}
	var at, deleted, took int64
	var batches int
	err = s.db.QueryRowxContext(ctx, `SELECT purged_at, deleted, batches, took_us FROM `+s.db.Dialect.Quote(name)+` WHERE id = 1`).Scan(&at, &deleted, &batches, &took)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return PurgeRecord{}, nil
	case err != nil:
		return PurgeRecord{}, fmt.Errorf("dedup: read the last purge of %s from %s: %w", s.table, name, err)
	}
	return PurgeRecord{At: time.UnixMicro(at), Deleted: deleted, Batches: batches, Took: time.Duration(took) * time.Microsecond}, nil
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

// HandlerStats describes one handler's keys in the table.
type HandlerStats struct {
	// Keys is how many keys the handler has in the table, expired ones included: the messages
	// it applied within the retention, and since the last purge.
	Keys int64
	// Recent is how many of them were recorded at or after the time HandlerKeys was given.
	Recent int64
	// Last is when the newest was recorded: when the handler last applied a message.
	Last time.Time
}

// HandlerKeys counts each handler's keys, and those recorded at since or later. Like Stats, it
// reads the whole table in one statement: call it at the pace of a metrics scrape, not per
// message.
func (s *SQLStore) HandlerKeys(ctx context.Context, since time.Time) (map[string]HandlerStats, error) {
	rows, err := s.db.QueryContext(ctx, s.db.Rebind(`SELECT handler, COUNT(*), MAX(created_at), COUNT(CASE WHEN created_at >= ? THEN 1 END) FROM `+
		s.db.Dialect.Quote(s.table)+` GROUP BY handler`), since.UnixMicro())
	if err != nil {
		return nil, fmt.Errorf("dedup: count the keys of %s by handler: %w", s.table, err)
	}
	defer rows.Close()
	out := map[string]HandlerStats{}
	for rows.Next() {
		var h string
		var st HandlerStats
		var last int64
		if err := rows.Scan(&h, &st.Keys, &last, &st.Recent); err != nil {
			return nil, fmt.Errorf("dedup: count the keys of %s by handler: %w", s.table, err)
		}
		st.Last = time.UnixMicro(last)
		out[h] = st
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dedup: count the keys of %s by handler: %w", s.table, err)
	}
	return out, nil
}
