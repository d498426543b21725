package dedup

import (
	"context"
	"fmt"
	"strings"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/sqldb"
)

// sqlite is the SQLite dialect.
//
// Record is an upsert whose DO UPDATE only fires for an expired row; changes() (rows affected)
// is 0 for a live duplicate. SQLite has one writer at a time: with sqldb.Open's BEGIN
// IMMEDIATE, a second transaction waits in BEGIN until the first one ends, and then sees its
// key or not. TEXT compares byte by byte (the BINARY collation), so ids differing in case or in
// trailing spaces are different keys.
type sqlite struct {
	s *SQLStore

	manyPrefix, manySuffix string
}

const sqliteUpsert = ` ON CONFLICT (handler, message_id, message_ts) DO UPDATE
SET internal_id = excluded.internal_id, created_at = excluded.created_at, expires_at = excluded.expires_at
WHERE `

func (q *sqlite) queries(table string) queries {
	t := sqldb.SQLite.Quote(table)
	upsert := sqliteUpsert + t + `.expires_at <= excluded.created_at`
	q.manyPrefix = `INSERT INTO ` + t + ` (handler, message_id, message_ts, created_at, expires_at) VALUES `
	q.manySuffix = upsert + ` RETURNING handler, message_id, message_ts`
	return queries{
		record: `INSERT INTO ` + t + ` (handler, message_id, message_ts, internal_id, created_at, expires_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)` + upsert,
		lookup: `SELECT COALESCE(internal_id, '') FROM ` + t + `
WHERE handler = ?1 AND message_id = ?2 AND message_ts = ?3 AND expires_at > ?4`,
		forget: `DELETE FROM ` + t + ` WHERE handler = ?1 AND message_id = ?2 AND message_ts = ?3`,
		purge: `DELETE FROM ` + t + `
WHERE rowid IN (SELECT rowid FROM ` + t + ` WHERE expires_at <= ?1 LIMIT ?2)`,
		stats: `SELECT COUNT(*), COALESCE(MIN(created_at), 0), COUNT(CASE WHEN expires_at <= ?1 THEN 1 END) FROM ` + t,
	}
}

// expired returns those of keys that have an expired record, before the upsert replaces it:
// RETURNING shows only the new row, and SQLite runs one writer at a time, so nothing comes
// between the two statements.
func (q *sqlite) expired(ctx context.Context, tx sqlx.ExtContext, keys []Key, now int64) (map[Key]bool, error) {
	var b strings.Builder
	b.WriteString(`SELECT handler, message_id, message_ts FROM ` + sqldb.SQLite.Quote(q.s.table) + ` WHERE expires_at <= ? AND (handler, message_id, message_ts) IN (VALUES `)
	args := append([]any{now}, keyList(&b, keys, func() string { return "?" })...)
	b.WriteString(`)`)
	found, err := queryKeys(ctx, tx, b.String(), args, false)
	for k := range found {
		found[k] = true
	}
	return found, err
}

// recordOne runs the upsert; changes() is 0 for a live duplicate.
func (q *sqlite) recordOne(ctx context.Context, tx sqlx.ExtContext, key Key, iid any, created, expires int64) (Outcome, error) {
	old, err := q.expired(ctx, tx, []Key{key}, created)
	if err != nil {
		return Duplicate, err
	}
	res, err := tx.ExecContext(ctx, q.s.q.record, key.Handler, key.MessageID, key.Timestamp, iid, created, expires)
	if err != nil {
		return Duplicate, err
	}
	n, err := res.RowsAffected()
	switch {
	case err != nil:
		return Duplicate, fmt.Errorf("read rows affected: %w", err)
	case n == 0:
		return Duplicate, nil
	case len(old) > 0:
		return Renewed, nil
	}
	return Recorded, nil
}

// recordMany runs one INSERT ... ON CONFLICT ... RETURNING (SQLite 3.35 and later): the rows it
// returns are the keys it inserted or renewed. created_at and expires_at are ?1 and ?2 in every
// row.
func (q *sqlite) recordMany(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (map[Key]bool, error) {
	old, err := q.expired(ctx, tx, keys, created)
	if err != nil {
		return nil, err
	}
	query, args := recordManyStatement(q.manyPrefix, q.manySuffix, "?", keys, created, expires)
	recorded, err := queryKeys(ctx, tx, query, args, false)
	if err != nil {
		return nil, err
	}
	for k := range recorded {
		recorded[k] = old[k]
	}
	return recorded, nil
}

func (q *sqlite) migrate(ctx context.Context) error {
	// One transaction: SQLite runs one writer at a time, so concurrent migrations take turns.
	// A rowid table, which Purge's batches address by rowid.
	return sqltx.Exec(ctx, q.s.db, createTable(sqldb.SQLite, q.s.table), nil)
}
