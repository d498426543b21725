package dedup

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/sqldb"
)

// postgres is the PostgreSQL dialect.
//
// Record is an upsert whose DO UPDATE only fires for an expired row: a live duplicate makes it
// touch no row instead of raising a unique violation, which would abort the caller's
// transaction. When another transaction has inserted the same key and not committed yet,
// ON CONFLICT waits for it, then inserts (it rolled back) or sees the conflict (it committed).
type postgres struct {
	s *SQLStore

	manyPrefix, manySuffix string
}

// pgLockKey is an advisory lock key for purpose ($1) on table ($2) in the current schema: the
// first 64 bits of an MD5, so that stores of the same table name in two schemas of one database
// do not exclude each other.
const pgLockKey = `('x' || substr(md5('onceflow.dedup.' || $1::text || ':' || coalesce(current_schema(), '') || '.' || $2::text), 1, 16))::bit(64)::bigint`

// pgUpsert is the conflict clause shared by Record and RecordMany: replace an expired row only.
const pgUpsert = ` ON CONFLICT (handler, message_id, message_ts) DO UPDATE
SET internal_id = EXCLUDED.internal_id, created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
WHERE d.expires_at <= EXCLUDED.created_at`

func (p *postgres) queries(table string) queries {
	t := sqldb.Postgres.Quote(table)
	p.manyPrefix = `INSERT INTO ` + t + ` AS d (handler, message_id, message_ts, created_at, expires_at) VALUES `
	// xmax is 0 on a row version this statement inserted, and set on one it updated: a renewal.
	p.manySuffix = pgUpsert + ` RETURNING d.handler, d.message_id, d.message_ts, d.xmax <> 0`
	return queries{
		record: `INSERT INTO ` + t + ` AS d (handler, message_id, message_ts, internal_id, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6)` + pgUpsert + ` RETURNING d.xmax <> 0`,
		lookup: `SELECT COALESCE(internal_id, '') FROM ` + t + `
WHERE handler = $1 AND message_id = $2 AND message_ts = $3 AND expires_at > $4`,
		forget: `DELETE FROM ` + t + ` WHERE handler = $1 AND message_id = $2 AND message_ts = $3`,
		// ctid is a row version: a row renewed by a concurrent Record after the inner SELECT
		// has a new ctid and is not deleted; the outer expires_at test says so again.
		purge: `DELETE FROM ` + t + `
WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + t + ` WHERE expires_at <= $1 LIMIT $2)) AND expires_at <= $1`,
		stats: `SELECT COUNT(*), COALESCE(MIN(created_at), 0), COUNT(CASE WHEN expires_at <= $1 THEN 1 END) FROM ` + t,
	}
}

// recordOne runs the upsert, which returns a row for a key it inserted or renewed.
func (p *postgres) recordOne(ctx context.Context, tx sqlx.ExtContext, key Key, iid any, created, expires int64) (Outcome, error) {
	var renewed bool
	err := tx.QueryRowxContext(ctx, p.s.q.record, key.Handler, key.MessageID, key.Timestamp, iid, created, expires).Scan(&renewed)
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

// recordMany runs one INSERT ... ON CONFLICT ... RETURNING: the rows it returns are the keys it
// inserted or renewed. created_at and expires_at are $1 and $2 in every row.
func (p *postgres) recordMany(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (map[Key]bool, error) {
	query, args := recordManyStatement(p.manyPrefix, p.manySuffix, "$", keys, created, expires)
	return queryKeys(ctx, tx, query, args, true)
}

func (p *postgres) migrate(ctx context.Context) error {
	// Concurrent CREATE TABLE IF NOT EXISTS can fail with a unique violation on pg_type: the
	// transaction-scoped advisory lock makes concurrent migrations take turns.
	return sqltx.Exec(ctx, p.s.db, createTable(sqldb.Postgres, p.s.table), func(tx *sqlx.Tx) error {
		_, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgLockKey+`)`, "migrate", p.s.table)
		return err
	})
}
