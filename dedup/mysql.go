package dedup

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/sqldb"
)

// mysql is the MySQL and MariaDB dialect.
//
// Record is INSERT ... ON DUPLICATE KEY UPDATE whose assignments keep a live row unchanged and
// overwrite an expired one. Rows affected, as the server reports it without clientFoundRows,
// tells the outcome: 1 inserted, 2 replaced an expired row, 0 duplicate. INSERT IGNORE is not
// used: it turns unrelated errors into warnings. A second transaction inserting a key that an
// uncommitted one holds waits on the row lock, then sees the duplicate or inserts.
//
// handler and message_id use a binary, no-pad collation: ids that differ in case or in
// trailing spaces are different keys (utf8mb4_bin compares "abc" and "abc " as equal).
//
// RecordMany marks the rows it writes with a random batch_token, a column of its own, because
// no other value distinguishes this batch's write from one that another transaction committed
// with the same timestamps. MariaDB 10.5 and later return every row of the batch as it stands
// after the upsert (INSERT ... RETURNING), whose token tells what happened to it; MySQL has no
// RETURNING, and RecordMany reads the rows back with a second statement.
type mysql struct {
	s *SQLStore

	manyPrefix   string
	selectPrefix string

	// canReturn is whether the server has INSERT ... RETURNING, asked once (supportsReturning).
	returningOnce sync.Once
	canReturn     bool
}

// mysqlUpsert is the duplicate-key clause shared by Record and RecordMany. MySQL assigns from
// left to right with the new values visible to later assignments, so expires_at, which every
// condition tests, is assigned last. A renewed row gets the negated batch token, so that
// RecordMany tells it from an inserted one.
const mysqlUpsert = ` ON DUPLICATE KEY UPDATE
internal_id = IF(expires_at <= VALUES(created_at), VALUES(internal_id), internal_id),
created_at = IF(expires_at <= VALUES(created_at), VALUES(created_at), created_at),
batch_token = IF(expires_at <= VALUES(created_at), -VALUES(batch_token), batch_token),
expires_at = IF(expires_at <= VALUES(created_at), VALUES(expires_at), expires_at)`

// mysqlRecordRow is a row of RecordMany's upsert, and mysqlReturning what it returns on
// MariaDB.
const (
	mysqlRecordRow = "(?,?,?,NULL,?,?,?)"
	mysqlReturning = ` RETURNING handler, message_id, message_ts, batch_token`
)

// mysqlCollations are the binary no-pad collations, by preference; utf8mb4_bin, which pads, is
// the fallback on servers that have neither (MySQL 5.7, MariaDB before 10.2).
var mysqlCollations = []string{"utf8mb4_0900_bin", "utf8mb4_nopad_bin"}

func (m *mysql) queries(table string) queries {
	t := sqldb.MySQL.Quote(table)
	m.manyPrefix = `INSERT INTO ` + t + ` (handler, message_id, message_ts, internal_id, created_at, expires_at, batch_token) VALUES `
	m.selectPrefix = `SELECT handler, message_id, message_ts, batch_token < 0 FROM ` + t + `
WHERE batch_token IN (?, -?) AND (handler, message_id, message_ts) IN (`
	return queries{
		record: `INSERT INTO ` + t + ` (handler, message_id, message_ts, internal_id, created_at, expires_at, batch_token)
VALUES (?, ?, ?, ?, ?, ?, NULL)` + mysqlUpsert,
		lookup: `SELECT COALESCE(internal_id, '') FROM ` + t + `
WHERE handler = ? AND message_id = ? AND message_ts = ? AND expires_at > ?`,
		forget: `DELETE FROM ` + t + ` WHERE handler = ? AND message_id = ? AND message_ts = ?`,
		purge:  `DELETE FROM ` + t + ` WHERE expires_at <= ? LIMIT ?`,
		stats:  `SELECT COUNT(*), COALESCE(MIN(created_at), 0), COUNT(CASE WHEN expires_at <= ? THEN 1 END) FROM ` + t,
	}
}

// recordMany runs the multi-row upsert with a fresh batch token. On MariaDB it returns every
// row of the batch, and those carrying the token (or its negation, renewed) are exactly the
// keys it inserted or renewed. On MySQL, unless rows affected already settles it, a second
// statement selects the rows carrying the token; the transaction's own writes are visible to
// it at any isolation level.
func (m *mysql) recordMany(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (map[Key]bool, error) {
	token := rand.Int64N(math.MaxInt64) + 1 // positive: a renewed row gets its negation
	args := make([]any, 0, 6*len(keys))
	c, e, tok := any(created), any(expires), any(token) // boxed once for every row
	var handler any
	for i, k := range keys {
		if i == 0 || k.Handler != keys[i-1].Handler {
			handler = k.Handler // boxed once for a run of keys of one handler, a group's
		}
		args = append(args, handler, k.MessageID, k.Timestamp, c, e, tok)
	}
	if m.supportsReturning(ctx) {
		query := repeatRows(m.manyPrefix, mysqlRecordRow, mysqlUpsert+mysqlReturning, len(keys))
		return recordedByToken(ctx, tx, query, args, token)
	}
	res, err := tx.ExecContext(ctx, repeatRows(m.manyPrefix, mysqlRecordRow, mysqlUpsert, len(keys)), args...)
	if err != nil {
		return nil, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return nil, fmt.Errorf("read rows affected: %w", err)
	}
	switch n {
	case 0: // every key a live duplicate
		return nil, nil
	case 2 * int64(len(keys)): // every key replaced an expired row
		all := make(map[Key]bool, len(keys))
		for _, k := range keys {
			all[k] = true
		}
		return all, nil
	}

	args = append(args[:0], token, token)
	for _, k := range keys {
		args = append(args, k.Handler, k.MessageID, k.Timestamp)
	}
	return queryKeys(ctx, tx, repeatRows(m.selectPrefix, "(?,?,?)", ")", len(keys)), args, true)
}

// recordedByToken runs query, a multi-row upsert RETURNING (handler, message_id, message_ts,
// batch_token) of every row of the batch, and returns the keys whose rows carry token (new) or
// its negation (renewed, true); the others were live duplicates.
func recordedByToken(ctx context.Context, tx sqlx.ExtContext, query string, args []any, token int64) (map[Key]bool, error) {
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	keys := map[Key]bool{}
	for rows.Next() {
		var k Key
		var got sql.NullInt64
		if err := rows.Scan(&k.Handler, &k.MessageID, &k.Timestamp, &got); err != nil {
			return nil, err
		}
		switch got.Int64 {
		case token:
			keys[k] = false
		case -token:
			keys[k] = true
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return keys, rows.Close()
}

// supportsReturning reports whether the server has INSERT ... RETURNING: MariaDB 10.5 and
// later. It asks the server once; a server it cannot ask is taken not to.
func (m *mysql) supportsReturning(ctx context.Context) bool {
	m.returningOnce.Do(func() {
		var version string
		if err := m.s.db.QueryRowContext(ctx, `SELECT VERSION()`).Scan(&version); err == nil {
			m.canReturn = mariaDBReturns(version)
		}
	})
	return m.canReturn
}

// mariaDBReturns reports whether a server of version (SELECT VERSION()) is MariaDB 10.5 or
// later, whose INSERT has RETURNING.
func mariaDBReturns(version string) bool {
	if !strings.Contains(strings.ToLower(version), "mariadb") {
		return false
	}
	var major, minor int
	if _, err := fmt.Sscanf(version, "%d.%d", &major, &minor); err != nil {
		return false
	}
	return major > 10 || major == 10 && minor >= 5
}

// recordIfNew runs a plain multi-row INSERT: a key recorded already fails it with a duplicate
// key error, which rolls back the statement alone, whatever the connection's clientFoundRows.
func (m *mysql) recordIfNew(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (bool, error) {
	_, err := tx.ExecContext(ctx, repeatRows(m.manyPrefix, "(?,?,?,NULL,?,?,NULL)", "", len(keys)), rowArgs(keys, created, expires)...)
	if sqldb.Classify(err) == sqldb.UniqueViolation {
		return false, nil
	}
	return err == nil, err
}

// recordOne runs the upsert; rows affected, as the server reports it without clientFoundRows,
// is 1 for an insert, 2 for a renewed expired row and 0 for a live duplicate.
func (m *mysql) recordOne(ctx context.Context, tx sqlx.ExtContext, key Key, iid any, created, expires int64) (Outcome, error) {
	res, err := tx.ExecContext(ctx, m.s.q.record, key.Handler, key.MessageID, key.Timestamp, iid, created, expires)
	if err != nil {
		return Duplicate, err
	}
	n, err := res.RowsAffected()
	switch {
	case err != nil:
		return Duplicate, fmt.Errorf("read rows affected: %w", err)
	case n == 0:
		return Duplicate, nil
	case n == 2:
		return Renewed, nil
	}
	return Recorded, nil
}

func (m *mysql) migrate(ctx context.Context) error {
	collation := "utf8mb4_bin"
	rows, err := m.s.db.QueryContext(ctx, `SELECT COLLATION_NAME FROM information_schema.COLLATIONS WHERE COLLATION_NAME IN (?, ?)`,
		mysqlCollations[0], mysqlCollations[1])
	if err != nil {
		return fmt.Errorf("list collations: %w", err)
	}
	available := map[string]bool{}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			_ = rows.Close()
			return fmt.Errorf("list collations: %w", err)
		}
		available[name] = true
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return fmt.Errorf("list collations: %w", err)
	}
	for _, c := range mysqlCollations {
		if available[c] {
			collation = c
			break
		}
	}

	// The index is part of CREATE TABLE: MySQL has no CREATE INDEX IF NOT EXISTS. Concurrent
	// CREATE TABLE IF NOT EXISTS statements are serialised by the metadata lock on the name.
	t := sqldb.MySQL.Quote(m.s.table)
	cs := `CHARACTER SET utf8mb4 COLLATE ` + collation
	if _, err := m.s.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+t+` (
	handler     VARCHAR(200) `+cs+` NOT NULL,
	message_id  VARCHAR(255) `+cs+` NOT NULL,
	message_ts  BIGINT NOT NULL DEFAULT 0,
	internal_id VARCHAR(64) `+cs+` NULL,
	created_at  BIGINT NOT NULL,
	expires_at  BIGINT NOT NULL,
	batch_token BIGINT NULL,
	PRIMARY KEY (handler, message_id, message_ts),
	KEY `+sqldb.MySQL.Quote(indexName(m.s.table))+` (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=`+collation); err != nil {
		return err
	}
	return m.checkCollation(ctx)
}

// checkCollation fails when handler or message_id of an existing table compare with a
// case-insensitive collation, which would report different ids as duplicates.
func (m *mysql) checkCollation(ctx context.Context) error {
	rows, err := m.s.db.QueryContext(ctx, `SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME IN ('handler', 'message_id')`, m.s.table)
	if err != nil {
		return fmt.Errorf("read column collations: %w", err)
	}
	defer rows.Close()
	var bad []string
	for rows.Next() {
		var column string
		var collation sql.NullString // NULL for binary strings, which compare byte by byte
		if err := rows.Scan(&column, &collation); err != nil {
			return fmt.Errorf("read column collations: %w", err)
		}
		if collation.Valid && !strings.HasSuffix(collation.String, "_bin") {
			bad = append(bad, fmt.Sprintf("%s has collation %s", column, collation.String))
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read column collations: %w", err)
	}
	if len(bad) > 0 {
		return fmt.Errorf("existing table compares ids case-insensitively (%s): ids differing only in case would be taken for duplicates; "+
			"convert the columns to a binary collation such as %s", strings.Join(bad, ", "), mysqlCollations[1])
	}
	return nil
}
