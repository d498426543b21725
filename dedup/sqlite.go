package dedup

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/sqldb"
)

// sqlite is the SQLite dialect.
//
// Record is an upsert whose DO UPDATE only fires for an expired row; RETURNING gives no row for
// a live duplicate. SQLite has one writer at a time: with sqldb.Open's BEGIN IMMEDIATE, a
// second transaction waits in BEGIN until the first one ends, and then sees its key or not.
// TEXT compares byte by byte (the BINARY collation), so ids differing in case or in trailing
// spaces are different keys.
//
// RETURNING shows the row as written, not what was there before, so a renewed record (an
// expired one the upsert replaced) is told from a new one by its rowid: the table is a rowid
// table, a row the upsert inserts gets a rowid above the largest one before the statement,
// and a row it updates keeps its own. The largest rowid is read first, in the same
// transaction, where no other writer can come between.
type sqlite struct {
	s *SQLStore

	manyPrefix, manySuffix, maxRowid string
}

// sqliteFresh ends the plain insert of keys expected to be new: one that is recorded is left
// alone, and the count of rows written tells.
const sqliteFresh = ` ON CONFLICT (handler, message_id, message_ts) DO NOTHING`

const sqliteUpsert = ` ON CONFLICT (handler, message_id, message_ts) DO UPDATE
SET internal_id = excluded.internal_id, created_at = excluded.created_at, expires_at = excluded.expires_at
WHERE `

func (q *sqlite) queries(table string) queries {
	t := sqldb.SQLite.Quote(table)
	upsert := sqliteUpsert + t + `.expires_at <= excluded.created_at`
	q.manyPrefix = `INSERT INTO ` + t + ` (handler, message_id, message_ts, created_at, expires_at) VALUES `
	// The rowid of a renewed row is at most the largest before, the last parameter.
	q.manySuffix = upsert + ` RETURNING handler, message_id, message_ts, rowid <= ?`
	q.maxRowid = `SELECT COALESCE(MAX(rowid), 0) FROM ` + t
	return queries{
		record: `INSERT INTO ` + t + ` (handler, message_id, message_ts, internal_id, created_at, expires_at)
VALUES (?, ?, ?, ?, ?, ?)` + upsert + ` RETURNING rowid <= ?`,
		lookup: `SELECT COALESCE(internal_id, '') FROM ` + t + `
WHERE handler = ?1 AND message_id = ?2 AND message_ts = ?3 AND expires_at > ?4`,
		forget: `DELETE FROM ` + t + ` WHERE handler = ?1 AND message_id = ?2 AND message_ts = ?3`,
		purge: `DELETE FROM ` + t + `
WHERE rowid IN (SELECT rowid FROM ` + t + ` WHERE expires_at <= ?1 LIMIT ?2)`,
		stats: `SELECT COUNT(*), COALESCE(MIN(created_at), 0), COUNT(CASE WHEN expires_at <= ?1 THEN 1 END) FROM ` + t,
	}
}

// lastRowid returns the largest rowid of the table, 0 when it is empty.
func (q *sqlite) lastRowid(ctx context.Context, tx sqlx.ExtContext) (int64, error) {
	var n int64
	err := tx.QueryRowxContext(ctx, q.maxRowid).Scan(&n)
	return n, err
}

// recordOne runs the upsert, which returns a row for a key it inserted or renewed.
func (q *sqlite) recordOne(ctx context.Context, tx sqlx.ExtContext, key Key, iid any, created, expires int64) (Outcome, error) {
	last, err := q.lastRowid(ctx, tx)
	if err != nil {
		return Duplicate, err
	}
	var renewed bool
	err = tx.QueryRowxContext(ctx, q.s.q.record, key.Handler, key.MessageID, key.Timestamp, iid, created, expires, last).Scan(&renewed)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return Duplicate, nil
	case err != nil:
		return Duplicate, err
	case renewed:
		return Renewed, nil
	}
	return Recorded, nil
}

// recordMany runs one INSERT ... ON CONFLICT ... RETURNING (SQLite 3.35 and later): the rows it
// returns are the keys it inserted or renewed.
//
// Its placeholders are anonymous, five to a row: the driver looks up the name of every
// numbered placeholder (?n) as it binds it, which took 8% of the CPU of a 64-key group's write
// transaction, more than binding created_at and expires_at in every row costs.
func (q *sqlite) recordMany(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (map[Key]bool, error) {
	last, err := q.lastRowid(ctx, tx)
	if err != nil {
		return nil, err
	}
	query := repeatRows(q.manyPrefix, "(?,?,?,?,?)", q.manySuffix, len(keys))
	return queryKeys(ctx, tx, query, append(rowArgs(keys, created, expires), last), true)
}

// recordIfNew runs the plain multi-row insert, without RETURNING and without reading the
// largest rowid first.
func (q *sqlite) recordIfNew(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (bool, error) {
	res, err := tx.ExecContext(ctx, repeatRows(q.manyPrefix, "(?,?,?,?,?)", sqliteFresh, len(keys)), rowArgs(keys, created, expires)...)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == int64(len(keys)), err
}

func (q *sqlite) migrate(ctx context.Context) error {
	// One transaction: SQLite runs one writer at a time, so concurrent migrations take turns.
	// A rowid table, which Purge's batches address by rowid.
	return sqltx.Exec(ctx, q.s.db, createTable(sqldb.SQLite, q.s.table), nil)
}
