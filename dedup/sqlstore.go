package dedup

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/sqldb"
)

// Column sizes of the dedup table, in characters. Record, RecordMany, Lookup and Forget reject
// longer values with ErrKeyTooLong before any statement runs.
const (
	MaxHandlerLen    = 200
	MaxMessageIDLen  = 255
	MaxInternalIDLen = 64
)

// maxKeysPerStatement bounds the rows of one multi-row INSERT in RecordMany, well below the
// parameter limits of every dialect (SQLite 32766, PostgreSQL 65535).
const maxKeysPerStatement = 1000

// ErrInvalidKey reports a key that cannot be stored: an empty message id, a value that is not
// valid UTF-8 or holds a NUL byte, or (see ErrKeyTooLong) a value longer than its column. Such a
// message can never be deduplicated; retrying does not help.
var ErrInvalidKey = errors.New("invalid dedup key")

// ErrKeyTooLong reports a handler name, message id or internal id longer than its column
// (MaxHandlerLen, MaxMessageIDLen, MaxInternalIDLen). errors.Is(err, ErrInvalidKey) holds for
// these errors too.
var ErrKeyTooLong = errors.New("dedup key too long")

// keyError is an invalid key: it matches ErrInvalidKey and, when tooLong, ErrKeyTooLong.
type keyError struct {
	msg     string
	tooLong bool
}

func (e *keyError) Error() string { return e.msg }

func (e *keyError) Is(target error) bool {
	return target == ErrInvalidKey || (e.tooLong && target == ErrKeyTooLong)
}

// Config configures an SQLStore. The zero value is valid.
type Config struct {
	// Table is the name of the dedup table, a plain SQL identifier (see
	// sqldb.CheckIdentifier). Defaults to DefaultTable.
	Table string
	// Retention is how long a key is kept: a key expires Retention after it was recorded, and
	// an expired key no longer counts as a duplicate. It must outlive the longest time the
	// broker may take to redeliver a message. Must not be negative. Defaults to
	// DefaultRetention.
	Retention time.Duration
	// Now returns the current time; expiry is computed from it on the client, so the clocks
	// of the nodes sharing one table should agree to well within Retention. Defaults to
	// time.Now. Tests set it.
	Now func() time.Time
}

// Validate reports the first invalid field of c, by name.
func (c Config) Validate() error {
	if c.Table != "" {
		if err := sqldb.CheckIdentifier("Table", c.Table); err != nil {
			return err
		}
	}
	if c.Retention < 0 {
		return fmt.Errorf("Retention: must not be negative, got %s", c.Retention)
	}
	return nil
}

// SQLStore is the dedup Store on an SQL database: one table, shared by every process that uses
// the same database and table name. It is safe for concurrent use.
//
// Besides Store it offers RecordMany and Forget for group commit, and Migrate, Purge and Stats
// for operations.
type SQLStore struct {
	db        *sqldb.DB
	dialect   dialect
	table     string
	retention time.Duration
	now       func() time.Time
	q         queries
}

var _ Store = (*SQLStore)(nil)

// queries is the SQL text of one store, built once by New.
//
// record, lookup, forget and purge take their arguments in this order:
//
//	record: handler, message_id, message_ts, internal_id (nil for NULL), created_at, expires_at
//	lookup: handler, message_id, message_ts, now
//	forget: handler, message_id, message_ts
//	purge:  now, batch size
//	stats:  now
//
// Record reports a fresh key when the statement affects at least one row.
type queries struct {
	record, lookup, forget, purge, stats string
}

// dialect is what differs between the SQL dialects: everything else in SQLStore is shared.
type dialect interface {
	// queries returns the fixed SQL text for table (already validated).
	queries(table string) queries
	// recordOne records key in tx with the record statement and says what it did.
	recordOne(ctx context.Context, tx sqlx.ExtContext, key Key, iid any, created, expires int64) (Outcome, error)
	// migrate creates the table and its index if they are missing.
	migrate(ctx context.Context) error
}

// New returns the store for db, whose Dialect chooses the SQL. It does not touch the database:
// call Migrate (or create the table as Migrate does) before the first Record.
//
// On MySQL and MariaDB, Record reads "rows affected" as the server reports it by default: the
// connection must not set clientFoundRows, under which a duplicate would count as new.
// sqldb.Open never sets it.
func New(db *sqldb.DB, cfg Config) (*SQLStore, error) {
	if db == nil || db.DB == nil {
		return nil, errors.New("dedup.New: db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("dedup.New: %w", err)
	}
	s := &SQLStore{
		db:        db,
		table:     cmp.Or(cfg.Table, DefaultTable),
		retention: cmp.Or(cfg.Retention, DefaultRetention),
		now:       cfg.Now,
	}
	if s.now == nil {
		s.now = time.Now
	}
	switch db.Dialect {
	case sqldb.Postgres:
		s.dialect = &postgres{s: s}
	case sqldb.MySQL:
		s.dialect = &mysql{s: s}
	case sqldb.SQLite:
		s.dialect = &sqlite{s: s}
	default:
		return nil, fmt.Errorf("dedup.New: db.Dialect: unsupported dialect %q (want postgres, mysql or sqlite)", db.Dialect)
	}
	s.q = s.dialect.queries(s.table)
	return s, nil
}

// Table returns the name of the store's table.
func (s *SQLStore) Table() string { return s.table }

// Outcome is what recording a key did.
type Outcome int

// The outcomes of RecordKey and RecordKeys.
const (
	// Duplicate: the key is recorded and has not expired; nothing was written.
	Duplicate Outcome = iota
	// Recorded: the key was new, and is recorded now.
	Recorded
	// Renewed: an expired record of the key was still in the table, and was replaced. The
	// message was processed before, longer ago than the retention: a redelivery beyond the
	// retention horizon, which a store without the expired row would take for new.
	Renewed
)

// New reports whether o recorded the key (Recorded or Renewed).
func (o Outcome) New() bool { return o != Duplicate }

// Record inserts key with internalID (which may be empty) in tx and reports whether it was
// newly recorded; see Store.Record and RecordKey, which tells a renewed expired key apart.
func (s *SQLStore) Record(ctx context.Context, tx sqlx.ExtContext, key Key, internalID string) (bool, error) {
	o, err := s.RecordKey(ctx, tx, key, internalID)
	return o.New(), err
}

// RecordKey inserts key with internalID (which may be empty) in tx and says what it did. It runs
// one statement (on SQLite two), which does not fail on an existing key, so tx stays usable
// whatever the outcome: a duplicate leaves no error behind, not even on PostgreSQL. An invalid
// key (ErrInvalidKey, ErrKeyTooLong) is rejected before any statement runs.
//
// The key expires Retention after now. A key recorded earlier but expired is replaced and
// reported as Renewed.
//
// On PostgreSQL, run it at READ COMMITTED (the default): under REPEATABLE READ or SERIALIZABLE
// a key committed concurrently by another transaction makes the statement fail with a
// serialization failure (sqldb.Conflict, retryable) instead of reporting a duplicate.
func (s *SQLStore) RecordKey(ctx context.Context, tx sqlx.ExtContext, key Key, internalID string) (Outcome, error) {
	if tx == nil {
		return Duplicate, errors.New("dedup: Record: tx is nil")
	}
	if err := checkKey(key); err != nil {
		return Duplicate, err
	}
	if err := checkValue("internal id", internalID, MaxInternalIDLen); err != nil {
		return Duplicate, err
	}
	var iid any // NULL for an empty internal id
	if internalID != "" {
		iid = internalID
	}
	now := s.now()
	o, err := s.dialect.recordOne(ctx, tx, key, iid, now.UnixMicro(), now.Add(s.retention).UnixMicro())
	if err != nil {
		return Duplicate, s.keyErr("record", key, err)
	}
	return o, nil
}

// Retention returns how long the store keeps a key.
func (s *SQLStore) Retention() time.Duration { return s.retention }

// Lookup returns the internal id recorded for key and whether an unexpired record of it exists;
// see Store.Lookup. It only reads, takes no lock, and returns "" for a key recorded without an
// internal id. A key recorded by a transaction that has not committed yet is not found.
func (s *SQLStore) Lookup(ctx context.Context, tx sqlx.ExtContext, key Key) (string, bool, error) {
	if tx == nil {
		return "", false, errors.New("dedup: Lookup: tx is nil")
	}
	if err := checkKey(key); err != nil {
		return "", false, err
	}
	var id string
	err := tx.QueryRowxContext(ctx, s.q.lookup, key.Handler, key.MessageID, key.Timestamp, s.now().UnixMicro()).Scan(&id)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return "", false, nil
	case err != nil:
		return "", false, s.keyErr("look up", key, err)
	}
	return id, true, nil
}

// Forget deletes key in tx, whether it has expired or not. Group commit uses it for a member
// of a batch whose savepoint rolled back: its key was recorded with the others, but its effect
// was not applied, so a redelivery must find it new. Forgetting a key that is not recorded is
// not an error.
func (s *SQLStore) Forget(ctx context.Context, tx sqlx.ExtContext, key Key) error {
	if tx == nil {
		return errors.New("dedup: Forget: tx is nil")
	}
	if err := checkKey(key); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, s.q.forget, key.Handler, key.MessageID, key.Timestamp); err != nil {
		return s.keyErr("forget", key, err)
	}
	return nil
}

// Migrate creates the table and its index on expires_at when they do not exist, and the table
// that records the last Purge (LastPurge), and leaves them alone when they do. It is idempotent and safe to run from several processes at once.
// On MySQL and MariaDB it also checks that an existing table compares handler and message_id
// case-sensitively, and fails when it does not, since such a table reports different ids
// as duplicates.
func (s *SQLStore) Migrate(ctx context.Context) error {
	if err := s.dialect.migrate(ctx); err != nil {
		return fmt.Errorf("dedup: migrate table %s: %w", s.table, err)
	}
	if err := s.migratePurges(ctx); err != nil {
		return fmt.Errorf("dedup: migrate table %s: %w", purgesTable(s.table), err)
	}
	return nil
}

func (s *SQLStore) keyErr(op string, key Key, err error) error {
	return fmt.Errorf("dedup: %s %s in %s: %w", op, describeKey(key), s.table, err)
}

// checkKey returns a *keyError when key cannot be stored, before it reaches the database: a
// value PostgreSQL rejects (invalid UTF-8, NUL) would abort the caller's transaction, and MySQL
// outside strict mode would truncate a long value and report a false duplicate.
func checkKey(key Key) error {
	if key.MessageID == "" {
		return &keyError{msg: fmt.Sprintf("%s: message id is empty (handler %q)", ErrInvalidKey, key.Handler)}
	}
	if err := checkValue("handler", key.Handler, MaxHandlerLen); err != nil {
		return err
	}
	return checkValue("message id", key.MessageID, MaxMessageIDLen)
}

func checkValue(what, v string, maxLen int) error {
	switch fault, n := textcol.Check(v, maxLen); fault {
	case textcol.TooLong:
		return &keyError{tooLong: true, msg: fmt.Sprintf("%s: %s %s has %d characters, more than the %d its column holds",
			ErrKeyTooLong, what, textcol.Quote(v), n, maxLen)}
	case textcol.NotUTF8:
		return &keyError{msg: fmt.Sprintf("%s: %s %s is not valid UTF-8", ErrInvalidKey, what, textcol.Quote(v))}
	case textcol.NUL:
		return &keyError{msg: fmt.Sprintf("%s: %s %s contains a NUL byte", ErrInvalidKey, what, textcol.Quote(v))}
	}
	return nil
}

func describeKey(k Key) string {
	if k.Timestamp != 0 {
		return fmt.Sprintf("key (handler %s, message id %s, timestamp %d)", textcol.Quote(k.Handler), textcol.Quote(k.MessageID), k.Timestamp)
	}
	return fmt.Sprintf("key (handler %s, message id %s)", textcol.Quote(k.Handler), textcol.Quote(k.MessageID))
}

// indexName returns the name of the table's expires_at index, at most 63 characters (the
// PostgreSQL limit; PostgreSQL would otherwise truncate it to the table's own name).
func indexName(table string) string {
	const suffix = "_expires_at"
	if len(table)+len(suffix) <= 63 {
		return table + suffix
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(table))
	return fmt.Sprintf("%s_%08x%s", table[:63-len(suffix)-9], h.Sum32(), suffix)
}

// createTable returns the statements that create the table and its expiry index on PostgreSQL
// and SQLite, which share them (MySQL declares the index inside CREATE TABLE).
//
// The primary key starts with message_id: a key's columns are compared from the first, and
// the handler is the same in most rows of a table, so a key led by it makes every comparison
// of the index's descent compare two equal strings first. On PostgreSQL the text columns
// compare byte by byte (COLLATE "C"), which is all duplicate detection needs, instead of by the
// database's locale rules. An insert of a key cost PostgreSQL about 9-10 µs with the key led by
// the handler in the database's collation, 7.5-8 µs so (bench/NOTES.md). A table created
// before keeps its key: every statement names the three columns, and works with either.
func createTable(d sqldb.Dialect, table string) []string {
	t := d.Quote(table)
	collate := ""
	if d == sqldb.Postgres {
		collate = ` COLLATE "C"`
	}
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t + ` (
	handler     VARCHAR(200)` + collate + ` NOT NULL,
	message_id  VARCHAR(255)` + collate + ` NOT NULL,
	message_ts  BIGINT       NOT NULL DEFAULT 0,
	internal_id VARCHAR(64),
	created_at  BIGINT       NOT NULL,
	expires_at  BIGINT       NOT NULL,
	PRIMARY KEY (message_id, handler, message_ts)
)`,
		`CREATE INDEX IF NOT EXISTS ` + d.Quote(indexName(table)) + ` ON ` + t + ` (expires_at)`,
	}
}
