package dedup

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqllock"
	"github.com/onceflow/onceflow/internal/sqltx"
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
	// recordMany records keys (distinct, valid, at most maxKeysPerStatement) in tx with one
	// multi-row statement, plus at most one other statement, and returns those it recorded,
	// each with whether it replaced an expired record.
	recordMany(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (map[Key]bool, error)
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

// RecordMany records keys in tx for group commit, where one transaction carries several
// messages, and reports for each position whether that key was newly recorded; see RecordKeys.
func (s *SQLStore) RecordMany(ctx context.Context, tx sqlx.ExtContext, keys []Key) ([]bool, error) {
	outcomes, err := s.RecordKeys(ctx, tx, keys)
	if err != nil {
		return nil, err
	}
	fresh := make([]bool, len(outcomes))
	for i, o := range outcomes {
		fresh[i] = o.New()
	}
	return fresh, nil
}

// RecordKeys records keys in tx for group commit, where one transaction carries several
// messages, and says for each position what it did, with the semantics of RecordKey:
// Duplicate for a key recorded before and not expired, Recorded for a new one, Renewed for an
// expired one it replaced. A key that appears more than once in keys is new at most at its
// first position; its later positions report Duplicate. The keys are recorded without an
// internal id.
//
// It runs one statement per 1000 distinct keys, never one statement per key, and leaves tx
// usable: on PostgreSQL an INSERT over three arrays (one statement text for every batch size)
// that returns only the duplicates and renewals; elsewhere a multi-row INSERT (on MySQL and
// MariaDB, which lack INSERT ... RETURNING, followed by at most one SELECT of the rows it
// wrote; on SQLite preceded by one SELECT of the expired records among them). Keys are written in a fixed order, so that
// concurrent batches sharing keys wait for each other rather than deadlock; a deadlock or
// serialization failure that happens all the same is retryable (sqldb.Conflict). An invalid key
// anywhere in keys fails the whole call before any statement runs; the error names its
// position.
func (s *SQLStore) RecordKeys(ctx context.Context, tx sqlx.ExtContext, keys []Key) ([]Outcome, error) {
	if tx == nil {
		return nil, errors.New("dedup: RecordMany: tx is nil")
	}
	fresh := make([]Outcome, len(keys)) // Duplicate unless recorded below
	if len(keys) == 0 {
		return fresh, nil
	}
	// The keys in their fixed order; of a repeated key, its first position comes first.
	order := make([]int, len(keys))
	for i, k := range keys {
		if err := checkKey(k); err != nil {
			return nil, fmt.Errorf("keys[%d]: %w", i, err)
		}
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Or(compareKeys(keys[a], keys[b]), cmp.Compare(a, b)) })
	distinct := make([]Key, 0, len(keys))
	at := make([]int, 0, len(keys)) // the position in keys of each distinct key
	for j, i := range order {
		if j > 0 && keys[order[j-1]] == keys[i] {
			continue
		}
		distinct = append(distinct, keys[i])
		at = append(at, i)
	}

	now := s.now()
	created, expires := now.UnixMicro(), now.Add(s.retention).UnixMicro()
	for start := 0; start < len(distinct); start += maxKeysPerStatement {
		chunk := distinct[start:min(start+maxKeysPerStatement, len(distinct))]
		pos := at[start : start+len(chunk)]
		if err := s.recordChunk(ctx, tx, chunk, pos, fresh, created, expires); err != nil {
			return nil, fmt.Errorf("dedup: record %d keys in %s: %w", len(chunk), s.table, err)
		}
	}
	return fresh, nil
}

// recordChunk records chunk (distinct, valid, sorted) and sets fresh at pos, the positions of
// chunk's keys, for those it recorded.
func (s *SQLStore) recordChunk(ctx context.Context, tx sqlx.ExtContext, chunk []Key, pos []int, fresh []Outcome, created, expires int64) error {
	if er, ok := s.dialect.(exceptionRecorder); ok {
		exceptions, err := er.recordExceptions(ctx, tx, chunk, created, expires)
		if err != nil {
			return err
		}
		for _, i := range pos {
			fresh[i] = Recorded
		}
		for _, e := range exceptions {
			if e.index < 0 || e.index >= len(chunk) {
				return fmt.Errorf("the database returned position %d, which is not in the batch", e.index+1)
			}
			fresh[pos[e.index]] = e.outcome
		}
		return nil
	}
	recorded, err := s.dialect.recordMany(ctx, tx, chunk, created, expires)
	if err != nil {
		return err
	}
	for k, renewed := range recorded {
		j, found := slices.BinarySearchFunc(chunk, k, compareKeys)
		if !found {
			return fmt.Errorf("the database returned %s, which is not in the batch", describeKey(k))
		}
		fresh[pos[j]] = Recorded
		if renewed {
			fresh[pos[j]] = Renewed
		}
	}
	return nil
}

// exceptionRecorder is a dialect that records a batch of keys with one statement returning only
// the keys that were not simply recorded: duplicates and renewed expired records.
type exceptionRecorder interface {
	// recordExceptions records keys (distinct, valid, sorted) in tx and returns the keys,
	// by index into keys, that it did not record as new: Duplicate or Renewed.
	recordExceptions(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) ([]exception, error)
}

// exception is a key of a batch that was not recorded as new.
type exception struct {
	index   int
	outcome Outcome
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

// Migrate creates the table and its index on expires_at when they do not exist, and leaves
// them alone when they do. It is idempotent and safe to run from several processes at once.
// On MySQL and MariaDB it also checks that an existing table compares handler and message_id
// case-sensitively, and fails when it does not, since such a table reports different ids
// as duplicates.
func (s *SQLStore) Migrate(ctx context.Context) error {
	if err := s.dialect.migrate(ctx); err != nil {
		return fmt.Errorf("dedup: migrate table %s: %w", s.table, err)
	}
	return nil
}

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

func compareKeys(a, b Key) int {
	return cmp.Or(strings.Compare(a.Handler, b.Handler), strings.Compare(a.MessageID, b.MessageID), cmp.Compare(a.Timestamp, b.Timestamp))
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
func createTable(d sqldb.Dialect, table string) []string {
	t := d.Quote(table)
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t + ` (
	handler     VARCHAR(200) NOT NULL,
	message_id  VARCHAR(255) NOT NULL,
	message_ts  BIGINT       NOT NULL DEFAULT 0,
	internal_id VARCHAR(64),
	created_at  BIGINT       NOT NULL,
	expires_at  BIGINT       NOT NULL,
	PRIMARY KEY (handler, message_id, message_ts)
)`,
		`CREATE INDEX IF NOT EXISTS ` + d.Quote(indexName(table)) + ` ON ` + t + ` (expires_at)`,
	}
}

// recordManyStatement builds the multi-row INSERT of recordMany on PostgreSQL ($n) and SQLite
// (?n), whose placeholders are numbered: created and expires are the first two, and every row
// refers to them.
func recordManyStatement(prefix, suffix, mark string, keys []Key, created, expires int64) (string, []any) {
	var b strings.Builder
	b.Grow(len(prefix) + len(suffix) + len(keys)*32)
	b.WriteString(prefix)
	args := make([]any, 2, 2+3*len(keys))
	args[0], args[1] = created, expires
	for i, k := range keys {
		if i > 0 {
			b.WriteByte(',')
		}
		n := 3 + 3*i
		b.WriteString("(" + mark)
		b.WriteString(strconv.Itoa(n))
		b.WriteString("," + mark)
		b.WriteString(strconv.Itoa(n + 1))
		b.WriteString("," + mark)
		b.WriteString(strconv.Itoa(n + 2))
		b.WriteString("," + mark + "1," + mark + "2)")
		args = append(args, k.Handler, k.MessageID, k.Timestamp)
	}
	b.WriteString(suffix)
	return b.String(), args
}

// queryKeys runs query on tx and scans the keys it returns as (handler, message_id, message_ts)
// and, when flagged, a fourth column that is true for a key that replaced an expired record.
func queryKeys(ctx context.Context, tx sqlx.ExtContext, query string, args []any, flagged bool) (map[Key]bool, error) {
	rows, err := tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	keys := map[Key]bool{}
	for rows.Next() {
		var k Key
		var renewed bool
		dest := []any{&k.Handler, &k.MessageID, &k.Timestamp}
		if flagged {
			dest = append(dest, &renewed)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		keys[k] = renewed
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return keys, rows.Close()
}

// keyList writes the row values "(p, p, p),(p, p, p)..." of keys to b, with mark the
// placeholder for each value, and returns the arguments.
func keyList(b *strings.Builder, keys []Key, mark func() string) []any {
	args := make([]any, 0, 3*len(keys))
	for i, k := range keys {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString("(" + mark() + "," + mark() + "," + mark() + ")")
		args = append(args, k.Handler, k.MessageID, k.Timestamp)
	}
	return args
}

// ErrHandlerTopic reports a handler name that another process uses for another topic: the two
// would share duplicate-detection keys, so that a message of one topic could be taken for a
// duplicate of a message of the other and never applied.
var ErrHandlerTopic = errors.New("handler name used for two topics")

// handlersTable returns the name of the table that records which topic each handler of the
// store consumes: the store's table with "_handlers", within 63 characters.
func handlersTable(table string) string {
	const suffix = "_handlers"
	if len(table)+len(suffix) <= 63 {
		return table + suffix
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(table))
	return fmt.Sprintf("%s_%08x%s", table[:63-len(suffix)-9], h.Sum32(), suffix)
}

// ClaimHandler records that handler consumes topic, and fails with an error wrapping
// ErrHandlerTopic, naming both topics, when the store has recorded handler for another topic
// before. Keys are made of the handler name and the message id, not the topic: a handler name
// must stay with one topic. The router calls it for each handler when it starts. It creates
// its table if needed.
func (s *SQLStore) ClaimHandler(ctx context.Context, handler, topic string) error {
	if err := checkKey(Key{Handler: handler, MessageID: topic}); err != nil {
		return fmt.Errorf("dedup: claim handler: %w", err)
	}
	d := s.db.Dialect
	t := d.Quote(handlersTable(s.table))
	textType := "VARCHAR(255)"
	opts := ""
	if d == sqldb.MySQL {
		textType = "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
		opts = " ENGINE=InnoDB"
	}
	create := `CREATE TABLE IF NOT EXISTS ` + t + ` (
	handler    ` + textType + ` NOT NULL PRIMARY KEY,
	topic      ` + textType + ` NOT NULL,
	claimed_at BIGINT NOT NULL
)` + opts
	var insert string
	switch d {
	case sqldb.MySQL:
		insert = `INSERT INTO ` + t + ` (handler, topic, claimed_at) VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE handler = handler`
	default:
		insert = s.db.Rebind(`INSERT INTO ` + t + ` (handler, topic, claimed_at) VALUES (?, ?, ?) ON CONFLICT (handler) DO NOTHING`)
	}
	var lock func(*sqlx.Tx) error
	if d == sqldb.Postgres {
		lock = func(tx *sqlx.Tx) error {
			_, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgLockKey+`)`, "migrate", handlersTable(s.table))
			return err
		}
	}
	if err := sqltx.Exec(ctx, s.db, []string{create}, lock); err != nil {
		return fmt.Errorf("dedup: create table %s: %w", handlersTable(s.table), err)
	}
	if _, err := s.db.ExecContext(ctx, insert, handler, topic, s.now().UnixMicro()); err != nil {
		return fmt.Errorf("dedup: claim handler %s for topic %s: %w", textcol.Quote(handler), textcol.Quote(topic), err)
	}
	var recorded string
	if err := s.db.QueryRowxContext(ctx, s.db.Rebind(`SELECT topic FROM `+t+` WHERE handler = ?`), handler).Scan(&recorded); err != nil {
		return fmt.Errorf("dedup: read the topic of handler %s: %w", textcol.Quote(handler), err)
	}
	if recorded != topic {
		return fmt.Errorf("%w: handler %q consumes topic %q here, but topic %q in %s of %s; "+
			"give one of them another Handler.Name (renaming makes every message new to it), or delete its row from %s if the old topic is gone",
			ErrHandlerTopic, handler, topic, recorded, handlersTable(s.table), s.db, handlersTable(s.table))
	}
	return nil
}
