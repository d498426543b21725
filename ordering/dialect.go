package ordering

import (
	"context"
	"fmt"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/sqldb"
)

// dialect is what differs between the SQL dialects: the DDL, the statements that lock a key's
// state and that read parked messages, and how the producer's sequence comes back. The
// statements are written with ? placeholders; NewStore and NewSequencer rebind them.
type dialect interface {
	// queries returns the statements of a store on the quoted tables.
	queries(state, parked, skipped string) queries
	// migrate creates the store's tables (unquoted names) if they are missing.
	migrate(ctx context.Context, db *sqldb.DB, state, parked, skipped string) error
	// next adds n to the producer sequence of (topic, key) in the quoted table, creating it at
	// 0, and returns the new value.
	next(ctx context.Context, tx sqlx.ExtContext, table, topic, key string, n int64) (int64, error)
	// migrateSeq creates the producer's sequence table (unquoted name) if it is missing.
	migrateSeq(ctx context.Context, db *sqldb.DB, table string) error
}

func dialectOf(d sqldb.Dialect) (dialect, error) {
	switch d {
	case sqldb.Postgres:
		return postgres{}, nil
	case sqldb.MySQL:
		return mysql{}, nil
	case sqldb.SQLite:
		return sqlite{}, nil
	}
	return nil, fmt.Errorf("unsupported dialect %q (want postgres, mysql or sqlite)", d)
}

// commonQueries are the statements every dialect shares; lockSuffix ends the statements that
// read rows the caller then changes (FOR UPDATE where the dialect has it).
func commonQueries(state, parked, skipped, lockSuffix string) queries {
	return queries{
		lock: `SELECT last_seq, parked, blocked_since, stalled FROM ` + state + ` WHERE handler = ? AND order_key = ?` + lockSuffix,
		update: `UPDATE ` + state + ` SET last_seq = ?, parked = ?, blocked_since = ?, stalled = ?
WHERE handler = ? AND order_key = ?`,
		load: `SELECT seq, message_id, message_ts, topic, headers, payload, internal_id, parked_at, attempts, last_error FROM ` + parked + `
WHERE handler = ? AND order_key = ? AND seq > ? ORDER BY seq LIMIT ?` + lockSuffix,
		deleteRange: `DELETE FROM ` + parked + ` WHERE handler = ? AND order_key = ? AND seq > ? AND seq <= ?`,
		deleteOne:   `DELETE FROM ` + parked + ` WHERE handler = ? AND order_key = ? AND seq = ? AND message_id = ?`,
		fail: `UPDATE ` + parked + ` SET attempts = attempts + 1, last_error = ?, failed_at = ?
WHERE handler = ? AND order_key = ? AND seq = ?`,
		skip: `INSERT INTO ` + skipped + ` (handler, order_key, from_seq, to_seq, reason, skipped_at) VALUES (?, ?, ?, ?, ?, ?)`,
		skippedAt: `SELECT from_seq, to_seq, reason, skipped_at FROM ` + skipped + `
WHERE handler = ? AND order_key = ? AND from_seq <= ? AND to_seq >= ? ORDER BY from_seq LIMIT 1` + lockSuffix,
		// blocked_since > 0 exactly when parked > 0; the index (handler, blocked_since) serves
		// all three.
		stalledKeys: `SELECT order_key, blocked_since FROM ` + state + `
WHERE handler = ? AND blocked_since > 0 AND stalled = 1 AND order_key > ? ORDER BY order_key LIMIT ?`,
		overdueKeys: `SELECT order_key, blocked_since FROM ` + state + `
WHERE handler = ? AND blocked_since > 0 AND blocked_since <= ? AND stalled = 0 AND order_key > ? ORDER BY order_key LIMIT ?`,
		stats: `SELECT COUNT(*), COALESCE(SUM(parked), 0), COALESCE(SUM(stalled), 0), COALESCE(MIN(blocked_since), 0) FROM ` + state + `
WHERE handler = ? AND blocked_since > 0`,
	}
}

// parkColumns is the column list of park.
const parkColumns = ` (handler, order_key, seq, message_id, message_ts, topic, headers, payload, internal_id, parked_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`

// postgres is the PostgreSQL dialect. The key's state row is locked with SELECT ... FOR UPDATE;
// a missing row is created with INSERT ... ON CONFLICT DO NOTHING, which does not abort the
// transaction when a concurrent one created it first (it waits for that one, then sees its row).
type postgres struct{}

// pgLock serialises concurrent migrations: concurrent CREATE TABLE IF NOT EXISTS can fail with a
// unique violation on pg_type.
const pgLock = `SELECT pg_advisory_xact_lock(('x' || substr(md5('onceflow.ordering.migrate:' || coalesce(current_schema(), '') || '.' || $1::text), 1, 16))::bit(64)::bigint)`

func (postgres) queries(state, parked, skipped string) queries {
	q := commonQueries(state, parked, skipped, ` FOR UPDATE`)
	q.create = `INSERT INTO ` + state + ` (handler, order_key) VALUES (?, ?) ON CONFLICT (handler, order_key) DO NOTHING`
	q.park = `INSERT INTO ` + parked + parkColumns + ` ON CONFLICT (handler, order_key, seq) DO NOTHING`
	// Each statement reads the latest committed rows at READ COMMITTED: the skipped ranges
	// need no lock.
	q.skippedAt = commonQueries(state, parked, skipped, "").skippedAt
	return q
}

func (postgres) migrate(ctx context.Context, db *sqldb.DB, state, parked, skipped string) error {
	q := sqldb.Postgres.Quote
	return sqltx.Exec(ctx, db, []string{
		`CREATE TABLE IF NOT EXISTS ` + q(state) + ` (
	handler       VARCHAR(200) NOT NULL,
	order_key     VARCHAR(255) NOT NULL,
	last_seq      BIGINT       NOT NULL DEFAULT 0,
	parked        BIGINT       NOT NULL DEFAULT 0,
	blocked_since BIGINT       NOT NULL DEFAULT 0,
	stalled       SMALLINT     NOT NULL DEFAULT 0,
	PRIMARY KEY (handler, order_key)
)`,
		`CREATE INDEX IF NOT EXISTS ` + q(state+"_blocked") + ` ON ` + q(state) + ` (handler, blocked_since)`,
		`CREATE TABLE IF NOT EXISTS ` + q(parked) + ` (
	handler     VARCHAR(200) NOT NULL,
	order_key   VARCHAR(255) NOT NULL,
	seq         BIGINT       NOT NULL,
	message_id  VARCHAR(255) NOT NULL,
	message_ts  BIGINT       NOT NULL DEFAULT 0,
	topic       VARCHAR(255) NOT NULL,
	headers     TEXT,
	payload     BYTEA        NOT NULL,
	internal_id VARCHAR(64),
	parked_at   BIGINT       NOT NULL,
	attempts    INTEGER      NOT NULL DEFAULT 0,
	last_error  TEXT,
	failed_at   BIGINT       NOT NULL DEFAULT 0,
	PRIMARY KEY (handler, order_key, seq)
)`,
		`CREATE TABLE IF NOT EXISTS ` + q(skipped) + ` (
	handler    VARCHAR(200) NOT NULL,
	order_key  VARCHAR(255) NOT NULL,
	from_seq   BIGINT       NOT NULL,
	to_seq     BIGINT       NOT NULL,
	reason     TEXT         NOT NULL,
	skipped_at BIGINT       NOT NULL,
	PRIMARY KEY (handler, order_key, from_seq)
)`,
	}, func(tx *sqlx.Tx) error {
		_, err := tx.ExecContext(ctx, pgLock, state)
		return err
	})
}

func (postgres) next(ctx context.Context, tx sqlx.ExtContext, table, topic, key string, n int64) (int64, error) {
	var last int64
	err := tx.QueryRowxContext(ctx, `INSERT INTO `+table+` AS s (topic, order_key, last_seq) VALUES ($1, $2, $3)
ON CONFLICT (topic, order_key) DO UPDATE SET last_seq = s.last_seq + EXCLUDED.last_seq RETURNING last_seq`, topic, key, n).Scan(&last)
	return last, err
}

func (postgres) migrateSeq(ctx context.Context, db *sqldb.DB, table string) error {
	return sqltx.Exec(ctx, db, []string{`CREATE TABLE IF NOT EXISTS ` + sqldb.Postgres.Quote(table) + ` (
	topic     VARCHAR(255) NOT NULL,
	order_key VARCHAR(255) NOT NULL,
	last_seq  BIGINT       NOT NULL,
	PRIMARY KEY (topic, order_key)
)`}, func(tx *sqlx.Tx) error {
		_, err := tx.ExecContext(ctx, pgLock, table)
		return err
	})
}

// mysql is the MySQL and MariaDB dialect. Names and keys are VARBINARY, so they compare byte
// by byte (no case folding, no trailing-space padding). The key's state row is created (or left
// alone) by an upsert before it is locked, which takes the row lock without the gap lock that a
// locking read of a missing row would take. Rows that the transaction then changes
// are read with FOR UPDATE: a locking read sees the latest committed rows, where a plain SELECT
// under REPEATABLE READ would see the transaction's older snapshot and miss a message parked
// by the transaction it waited for.
type mysql struct{}

func (mysql) queries(state, parked, skipped string) queries {
	q := commonQueries(state, parked, skipped, ` FOR UPDATE`)
	// The assignment leaves an existing row as it is: 0 rows affected, no error.
	q.create = `INSERT INTO ` + state + ` (handler, order_key) VALUES (?, ?) ON DUPLICATE KEY UPDATE last_seq = last_seq`
	q.park = `INSERT INTO ` + parked + parkColumns + ` ON DUPLICATE KEY UPDATE seq = seq`
	q.createFirst = true
	return q
}

func (mysql) migrate(ctx context.Context, db *sqldb.DB, state, parked, skipped string) error {
	q := sqldb.MySQL.Quote
	const tail = `) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`
	// The index is part of CREATE TABLE: MySQL has no CREATE INDEX IF NOT EXISTS. Concurrent
	// CREATE TABLE IF NOT EXISTS statements are serialised by the metadata lock on the name.
	for _, ddl := range []string{
		`CREATE TABLE IF NOT EXISTS ` + q(state) + ` (
	handler       VARBINARY(800)  NOT NULL,
	order_key     VARBINARY(1020) NOT NULL,
	last_seq      BIGINT   NOT NULL DEFAULT 0,
	parked        BIGINT   NOT NULL DEFAULT 0,
	blocked_since BIGINT   NOT NULL DEFAULT 0,
	stalled       SMALLINT NOT NULL DEFAULT 0,
	PRIMARY KEY (handler, order_key),
	KEY ` + q(state+"_blocked") + ` (handler, blocked_since)` + tail,
		`CREATE TABLE IF NOT EXISTS ` + q(parked) + ` (
	handler     VARBINARY(800)  NOT NULL,
	order_key   VARBINARY(1020) NOT NULL,
	seq         BIGINT          NOT NULL,
	message_id  VARBINARY(1020) NOT NULL,
	message_ts  BIGINT          NOT NULL DEFAULT 0,
	topic       VARBINARY(1020) NOT NULL,
	headers     LONGBLOB,
	payload     LONGBLOB        NOT NULL,
	internal_id VARBINARY(256),
	parked_at   BIGINT          NOT NULL,
	attempts    INT             NOT NULL DEFAULT 0,
	last_error  TEXT,
	failed_at   BIGINT          NOT NULL DEFAULT 0,
	PRIMARY KEY (handler, order_key, seq)` + tail,
		`CREATE TABLE IF NOT EXISTS ` + q(skipped) + ` (
	handler    VARBINARY(800)  NOT NULL,
	order_key  VARBINARY(1020) NOT NULL,
	from_seq   BIGINT NOT NULL,
	to_seq     BIGINT NOT NULL,
	reason     TEXT   NOT NULL,
	skipped_at BIGINT NOT NULL,
	PRIMARY KEY (handler, order_key, from_seq)` + tail,
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			return err
		}
	}
	return nil
}

// next uses LAST_INSERT_ID(expr): the server returns the value of expr as the statement's
// insert id, so one statement both adds and reads, as RETURNING does elsewhere.
func (mysql) next(ctx context.Context, tx sqlx.ExtContext, table, topic, key string, n int64) (int64, error) {
	res, err := tx.ExecContext(ctx, `INSERT INTO `+table+` (topic, order_key, last_seq) VALUES (?, ?, LAST_INSERT_ID(?))
ON DUPLICATE KEY UPDATE last_seq = LAST_INSERT_ID(last_seq + ?)`, topic, key, n, n)
	if err != nil {
		return 0, err
	}
	return res.LastInsertId()
}

func (mysql) migrateSeq(ctx context.Context, db *sqldb.DB, table string) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+sqldb.MySQL.Quote(table)+` (
	topic     VARBINARY(1020) NOT NULL,
	order_key VARBINARY(1020) NOT NULL,
	last_seq  BIGINT NOT NULL,
	PRIMARY KEY (topic, order_key)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`)
	return err
}

// sqlite is the SQLite dialect. SQLite has one writer at a time: with sqldb.Open's BEGIN
// IMMEDIATE, a transaction holds the database's write lock from its start, so a plain SELECT
// reads the key's state with nothing able to change it. TEXT compares byte by byte (BINARY).
type sqlite struct{}

func (sqlite) queries(state, parked, skipped string) queries {
	q := commonQueries(state, parked, skipped, "")
	q.create = `INSERT INTO ` + state + ` (handler, order_key) VALUES (?, ?) ON CONFLICT (handler, order_key) DO NOTHING`
	q.park = `INSERT INTO ` + parked + parkColumns + ` ON CONFLICT (handler, order_key, seq) DO NOTHING`
	return q
}

func (sqlite) migrate(ctx context.Context, db *sqldb.DB, state, parked, skipped string) error {
	q := sqldb.SQLite.Quote
	return sqltx.Exec(ctx, db, []string{
		`CREATE TABLE IF NOT EXISTS ` + q(state) + ` (
	handler       TEXT    NOT NULL,
	order_key     TEXT    NOT NULL,
	last_seq      INTEGER NOT NULL DEFAULT 0,
	parked        INTEGER NOT NULL DEFAULT 0,
	blocked_since INTEGER NOT NULL DEFAULT 0,
	stalled       INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (handler, order_key)
)`,
		`CREATE INDEX IF NOT EXISTS ` + q(state+"_blocked") + ` ON ` + q(state) + ` (handler, blocked_since)`,
		`CREATE TABLE IF NOT EXISTS ` + q(parked) + ` (
	handler     TEXT    NOT NULL,
	order_key   TEXT    NOT NULL,
	seq         INTEGER NOT NULL,
	message_id  TEXT    NOT NULL,
	message_ts  INTEGER NOT NULL DEFAULT 0,
	topic       TEXT    NOT NULL,
	headers     TEXT,
	payload     BLOB    NOT NULL,
	internal_id TEXT,
	parked_at   INTEGER NOT NULL,
	attempts    INTEGER NOT NULL DEFAULT 0,
	last_error  TEXT,
	failed_at   INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (handler, order_key, seq)
)`,
		`CREATE TABLE IF NOT EXISTS ` + q(skipped) + ` (
	handler    TEXT    NOT NULL,
	order_key  TEXT    NOT NULL,
	from_seq   INTEGER NOT NULL,
	to_seq     INTEGER NOT NULL,
	reason     TEXT    NOT NULL,
	skipped_at INTEGER NOT NULL,
	PRIMARY KEY (handler, order_key, from_seq)
)`,
	}, nil)
}

func (sqlite) next(ctx context.Context, tx sqlx.ExtContext, table, topic, key string, n int64) (int64, error) {
	var last int64
	err := tx.QueryRowxContext(ctx, `INSERT INTO `+table+` (topic, order_key, last_seq) VALUES (?, ?, ?)
ON CONFLICT (topic, order_key) DO UPDATE SET last_seq = last_seq + excluded.last_seq RETURNING last_seq`, topic, key, n).Scan(&last)
	return last, err
}

func (sqlite) migrateSeq(ctx context.Context, db *sqldb.DB, table string) error {
	return sqltx.Exec(ctx, db, []string{`CREATE TABLE IF NOT EXISTS ` + sqldb.SQLite.Quote(table) + ` (
	topic     TEXT    NOT NULL,
	order_key TEXT    NOT NULL,
	last_seq  INTEGER NOT NULL,
	PRIMARY KEY (topic, order_key)
)`}, nil)
}
