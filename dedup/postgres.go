package dedup

import (
	"context"
	"database/sql"
	"fmt"

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

	exceptions, fresh keysStatement
}

// keysStatement is a statement over a batch of keys, in three texts: over three arrays; over
// the handler and two arrays when the keys share their handler, as a group's keys do; and over
// the handler and the ids alone when, besides, no key has a timestamp, as a group's keys have
// none unless the handler keys by timestamp.
type keysStatement struct{ all, oneHandler, idsOnly string }

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
	// One text for every batch size, so that one prepared statement serves them all. The rows
	// go in the order of the arrays (the caller's fixed order); the outer query returns the
	// batch's keys that the insert did not write (duplicates: NULL) or wrote over an expired
	// record (renewals: true), by their position in the arrays. xmax is 0 on a row version a
	// statement inserted, and set on one it updated: a renewal.
	insert := `, ins AS (
	INSERT INTO ` + t + ` AS d (handler, message_id, message_ts, created_at, expires_at)
	SELECT handler, message_id, message_ts, $1::bigint, $2::bigint FROM k ORDER BY i` + pgUpsert + `
	RETURNING d.handler, d.message_id, d.message_ts, d.xmax <> 0 AS renewed
)
SELECT k.i, ins.renewed FROM k LEFT JOIN ins
ON ins.handler = k.handler AND ins.message_id = k.message_id AND ins.message_ts = k.message_ts
WHERE ins.renewed IS NOT FALSE`
	// A plain insert for keys expected to be new (TryRecordKeys): a key recorded already,
	// expired or not, is left alone, and the count of rows written tells.
	fresh := `
	INSERT INTO ` + t + ` AS d (handler, message_id, message_ts, created_at, expires_at)
	SELECT handler, message_id, message_ts, $1::bigint, $2::bigint FROM k ORDER BY i
	ON CONFLICT (handler, message_id, message_ts) DO NOTHING`
	keys := `WITH k AS (
	SELECT * FROM unnest($3::text[], $4::text[], $5::bigint[]) WITH ORDINALITY AS k(handler, message_id, message_ts, i)
)`
	// The same when every key has one handler ($3), as a group's keys do: one array fewer.
	keysOneHandler := `WITH k AS (
	SELECT $3::text AS handler, message_id, message_ts, i
	FROM unnest($4::text[], $5::bigint[]) WITH ORDINALITY AS k(message_id, message_ts, i)
)`
	// The same when, besides, no key has a timestamp: the ids alone.
	keysIDsOnly := `WITH k AS (
	SELECT $3::text AS handler, message_id, 0::bigint AS message_ts, i
	FROM unnest($4::text[]) WITH ORDINALITY AS k(message_id, i)
)`
	p.exceptions = keysStatement{all: keys + insert, oneHandler: keysOneHandler + insert, idsOnly: keysIDsOnly + insert}
	p.fresh = keysStatement{all: keys + fresh, oneHandler: keysOneHandler + fresh, idsOnly: keysIDsOnly + fresh}
	return queries{
		// The upsert's outcome is the count of rows of the SELECT around it: 0 for a duplicate,
		// 1 for a new key, 2 for a renewed one. Run as an Exec, which reads no rows, it goes
		// out with the transaction's BEGIN (see sqldb/postgres).
		record: `WITH ins AS (
	INSERT INTO ` + t + ` AS d (handler, message_id, message_ts, internal_id, created_at, expires_at)
	VALUES ($1, $2, $3, $4, $5, $6)` + pgUpsert + `
	RETURNING d.xmax <> 0 AS renewed
)
SELECT 1 FROM ins, generate_series(1, CASE WHEN ins.renewed THEN 2 ELSE 1 END)`,
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

// recordOne runs the upsert, whose count of rows is its outcome.
func (p *postgres) recordOne(ctx context.Context, tx sqlx.ExtContext, key Key, iid any, created, expires int64) (Outcome, error) {
	res, err := tx.ExecContext(ctx, p.s.q.record, key.Handler, key.MessageID, key.Timestamp, iid, created, expires)
	if err != nil {
		return Duplicate, err
	}
	switch n, err := res.RowsAffected(); {
	case err != nil:
		return Duplicate, err
	case n == 0:
		return Duplicate, nil
	case n == 1:
		return Recorded, nil
	case n == 2:
		return Renewed, nil
	default:
		return Duplicate, fmt.Errorf("the record statement gave %d rows, not 0, 1 or 2", n)
	}
}

// over returns the text of st for keys, and its arguments: created, expires, then the keys as
// three arrays, or as the handler and two arrays when they share their handler, or as the
// handler and the ids when, besides, none has a timestamp.
func (st keysStatement) over(keys []Key, created, expires int64) (string, []any) {
	ids := make([]string, len(keys))
	oneHandler, stamped := true, false
	for i, k := range keys {
		ids[i] = k.MessageID
		oneHandler = oneHandler && k.Handler == keys[0].Handler
		stamped = stamped || k.Timestamp != 0
	}
	if oneHandler && !stamped {
		return st.idsOnly, []any{created, expires, keys[0].Handler, ids}
	}
	stamps := make([]int64, len(keys))
	for i, k := range keys {
		stamps[i] = k.Timestamp
	}
	if oneHandler {
		return st.oneHandler, []any{created, expires, keys[0].Handler, ids, stamps}
	}
	all := make([]string, len(keys))
	for i, k := range keys {
		all[i] = k.Handler
	}
	return st.all, []any{created, expires, all, ids, stamps}
}

// recordIfNew inserts the keys that are not recorded, with a plain INSERT whose count of rows
// says whether each key was: it reads no rows, and, first in its transaction, goes out with the
// transaction's BEGIN (see sqldb/postgres).
func (p *postgres) recordIfNew(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (bool, error) {
	query, args := p.fresh.over(keys, created, expires)
	res, err := tx.ExecContext(ctx, query, args...)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == int64(len(keys)), err
}

// recordExceptions runs the exceptions statement and reads its rows.
func (p *postgres) recordExceptions(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) ([]exception, error) {
	query, args := p.exceptions.over(keys, created, expires)
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []exception
	for rows.Next() {
		var i int
		var renewed sql.NullBool
		if err := rows.Scan(&i, &renewed); err != nil {
			return nil, err
		}
		e := exception{index: i - 1, outcome: Duplicate}
		if renewed.Valid {
			e.outcome = Renewed
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return out, rows.Close()
}

func (p *postgres) migrate(ctx context.Context) error {
	// Concurrent CREATE TABLE IF NOT EXISTS can fail with a unique violation on pg_type: the
	// transaction-scoped advisory lock makes concurrent migrations take turns.
	return sqltx.Exec(ctx, p.s.db, createTable(sqldb.Postgres, p.s.table), func(tx *sqlx.Tx) error {
		_, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgLockKey+`)`, "migrate", p.s.table)
		return err
	})
}
