package ordering

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/sqldb"
)

// DefaultTable is the prefix of the consumer-side tables when StoreConfig.Table is empty:
// onceflow_order_state, onceflow_order_parked and onceflow_order_skipped.
const DefaultTable = "onceflow_order"

// MaxTableLen is the longest StoreConfig.Table: the longest derived name, the state table's
// index <Table>_state_blocked, must fit PostgreSQL's 63-character identifiers.
const MaxTableLen = 63 - len("_state_blocked")

// Column sizes, in characters. Keys and handler names that do not fit are refused before any
// statement runs.
const (
	// MaxKeyLen is the longest ordering key.
	MaxKeyLen = 255
	// MaxHandlerLen is the longest handler name, as in package dedup.
	MaxHandlerLen = 200
	// maxIDLen is the longest message id, as in package dedup.
	maxIDLen = 255
	// maxTopicLen is the longest topic name, as the router accepts.
	maxTopicLen = 255
	// maxErrorLen bounds the error text kept with a parked message that failed.
	maxErrorLen = 1000
)

// MaxSequence is the largest sequence number: sequences are stored as signed 64-bit integers.
const MaxSequence = 1<<63 - 1

// ErrInvalidKey reports an ordering key, sequence or handler name that cannot be stored: empty,
// too long, not valid UTF-8, holding a NUL byte, or a sequence outside 1..MaxSequence.
// Redelivering the message cannot change it, so the in-order interceptor treats it as a
// permanent failure.
var ErrInvalidKey = errors.New("invalid ordering key")

// StoreConfig configures a Store. The zero value is valid.
type StoreConfig struct {
	// Table is the prefix of the three tables, a plain SQL identifier (see
	// sqldb.CheckIdentifier) of at most MaxTableLen characters: <Table>_state (the last
	// applied sequence of each handler and key), <Table>_parked (messages that arrived before
	// their predecessors) and <Table>_skipped (sequences a gap policy gave up on). Handlers
	// may share them: the handler name is part of every key. Defaults to DefaultTable.
	Table string
}

// Validate reports the first invalid field of c, by name.
func (c StoreConfig) Validate() error {
	if c.Table == "" {
		return nil
	}
	if err := sqldb.CheckIdentifier("Table", c.Table); err != nil {
		return err
	}
	if len(c.Table) > MaxTableLen {
		return fmt.Errorf("Table: %q has %d characters, more than %d", c.Table, len(c.Table), MaxTableLen)
	}
	return nil
}

// Store holds the consumer-side ordering state of one database: for each handler and key, the
// last sequence applied, and the messages parked until their predecessors arrive. It is safe
// for concurrent use; build one per database and table prefix, and share it between handlers.
//
// Every method that takes a transaction works inside the caller's transaction (the handler's),
// so that the ordering state commits or rolls back with the business writes.
type Store struct {
	db      *sqldb.DB
	table   string
	state   string // unquoted table names
	parked  string
	skipped string
	q       queries
}

// keyState is one row of the state table.
type keyState struct {
	last    int64 // last applied sequence, 0 when none
	parked  int64 // messages parked for the key
	blocked int64 // Unix microseconds since when the key waits; 0 when parked is 0
	stalled bool  // the lowest parked message is next in sequence, but it failed
}

// parkedMsg is one row of the parked table.
type parkedMsg struct {
	Seq        int64
	MessageID  string
	Timestamp  int64 // Unix microseconds, 0 for none
	Topic      string
	Headers    []byte // JSON object of strings, or NULL
	Payload    []byte
	InternalID sql.NullString
	ParkedAt   int64
	Attempts   int64
	LastError  sql.NullString
}

// queries is the SQL text of one store, built once by NewStore, with the dialect's
// placeholders. Arguments, in order:
//
//	lock, create:  handler, key
//	update:        last_seq, parked, blocked_since, stalled, handler, key
//	park:          handler, key, seq, message_id, message_ts, topic, headers, payload, internal_id, parked_at
//	load:          handler, key, after seq, limit
//	deleteRange:   handler, key, after seq, up to seq
//	deleteOne:     handler, key, seq, message_id
//	fail:          last_error, failed_at, handler, key, seq
//	skip:          handler, key, from_seq, to_seq, reason, skipped_at
//	skippedAt:     handler, key, seq, seq
//	stalledKeys:   handler, after key, limit
//	overdueKeys:   handler, cutoff, after key, limit
//	stats:         handler
type queries struct {
	lock, create, update, park, load, deleteRange, deleteOne, fail, skip, skippedAt string
	stalledKeys, overdueKeys, stats                                                 string
	// createFirst makes lockKey run create before lock, always: on MySQL a locking read of a
	// missing row takes a gap lock, and two transactions that then insert new keys in the
	// same gap deadlock. Elsewhere lockKey creates the row only when lock finds none.
	createFirst bool
}

// NewStore returns the store for db, whose Dialect chooses the SQL. It does not touch the
// database: call Migrate before the first message.
func NewStore(db *sqldb.DB, cfg StoreConfig) (*Store, error) {
	if db == nil || db.DB == nil {
		return nil, errors.New("ordering.NewStore: db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("ordering.NewStore: %w", err)
	}
	table := cmp.Or(cfg.Table, DefaultTable)
	s := &Store{db: db, table: table, state: table + "_state", parked: table + "_parked", skipped: table + "_skipped"}
	d, err := dialectOf(db.Dialect)
	if err != nil {
		return nil, fmt.Errorf("ordering.NewStore: db.Dialect: %w", err)
	}
	s.q = d.queries(db.Dialect.Quote(s.state), db.Dialect.Quote(s.parked), db.Dialect.Quote(s.skipped))
	bind := sqlx.QUESTION
	if db.Dialect == sqldb.Postgres {
		bind = sqlx.DOLLAR
	}
	for _, p := range []*string{&s.q.lock, &s.q.create, &s.q.update, &s.q.park, &s.q.load, &s.q.deleteRange, &s.q.deleteOne,
		&s.q.fail, &s.q.skip, &s.q.skippedAt, &s.q.stalledKeys, &s.q.overdueKeys, &s.q.stats} {
		*p = sqlx.Rebind(bind, *p)
	}
	return s, nil
}

// Table returns the prefix of the store's tables.
func (s *Store) Table() string { return s.table }

// Tables returns the names of the store's three tables.
func (s *Store) Tables() (state, parked, skipped string) { return s.state, s.parked, s.skipped }

// Migrate creates the tables and their index when they do not exist, and leaves them alone when
// they do. It is idempotent and safe to run from several processes at once.
func (s *Store) Migrate(ctx context.Context) error {
	d, _ := dialectOf(s.db.Dialect)
	if err := d.migrate(ctx, s.db, s.state, s.parked, s.skipped); err != nil {
		return fmt.Errorf("ordering: migrate tables %s_*: %w", s.table, err)
	}
	return nil
}

// Stats describes the parked messages of one handler.
type Stats struct {
	// Parked is the number of parked messages: messages that arrived before one of their
	// predecessors and wait for it.
	Parked int64
	// BlockedKeys is the number of keys with parked messages.
	BlockedKeys int64
	// StalledKeys is the number of keys whose next message is parked but failed when it was
	// applied; the sweeper retries it.
	StalledKeys int64
	// OldestBlocked is since when the key that has waited longest waits; the zero time when
	// BlockedKeys is 0.
	OldestBlocked time.Time
}

// Stats reads the ordering state of handler in one statement over its blocked keys.
func (s *Store) Stats(ctx context.Context, handler string) (Stats, error) {
	var st Stats
	var oldest int64
	if err := s.db.QueryRowxContext(ctx, s.q.stats, handler).Scan(&st.BlockedKeys, &st.Parked, &st.StalledKeys, &oldest); err != nil {
		return Stats{}, fmt.Errorf("ordering: stats of handler %q in %s: %w", handler, s.state, err)
	}
	if st.BlockedKeys > 0 && oldest > 0 {
		st.OldestBlocked = time.UnixMicro(oldest)
	}
	return st, nil
}

// lockKey locks the state row of (handler, key) in tx, creating it at sequence 0 when missing,
// and returns it. The lock is held until tx ends: every transaction that applies or parks a
// message of the key takes it first, so they run one at a time per key.
func (s *Store) lockKey(ctx context.Context, tx sqlx.ExtContext, handler, key string) (keyState, error) {
	if !s.q.createFirst {
		st, found, err := s.selectKey(ctx, tx, handler, key)
		if err != nil || found {
			return st, err
		}
	}
	// A statement that does not fail on an existing row: a unique violation would abort a
	// PostgreSQL transaction.
	if _, err := tx.ExecContext(ctx, s.q.create, handler, key); err != nil {
		return keyState{}, fmt.Errorf("create the state of key %s: %w", textcol.Quote(key), err)
	}
	st, found, err := s.selectKey(ctx, tx, handler, key)
	if err == nil && !found {
		err = fmt.Errorf("the state of key %s vanished after it was created", textcol.Quote(key))
	}
	return st, err
}

func (s *Store) selectKey(ctx context.Context, tx sqlx.ExtContext, handler, key string) (keyState, bool, error) {
	var st keyState
	var stalled int64
	err := tx.QueryRowxContext(ctx, s.q.lock, handler, key).Scan(&st.last, &st.parked, &st.blocked, &stalled)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return st, false, nil
	case err != nil:
		return st, false, fmt.Errorf("lock the state of key %s: %w", textcol.Quote(key), err)
	}
	st.stalled = stalled != 0
	return st, true, nil
}

func (s *Store) updateKey(ctx context.Context, tx sqlx.ExtContext, handler, key string, st keyState) error {
	stalled := 0
	if st.stalled {
		stalled = 1
	}
	if _, err := tx.ExecContext(ctx, s.q.update, st.last, st.parked, st.blocked, stalled, handler, key); err != nil {
		return fmt.Errorf("update the state of key %s: %w", textcol.Quote(key), err)
	}
	return nil
}

// park inserts p for (handler, key) and reports whether it was inserted: false when a message
// with the same sequence is parked already.
func (s *Store) park(ctx context.Context, tx sqlx.ExtContext, handler, key string, p parkedMsg) (bool, error) {
	var headers any
	if p.Headers != nil {
		headers = string(p.Headers)
	}
	var iid any
	if p.InternalID.Valid {
		iid = p.InternalID.String
	}
	payload := p.Payload
	if payload == nil {
		payload = []byte{}
	}
	res, err := tx.ExecContext(ctx, s.q.park, handler, key, p.Seq, p.MessageID, p.Timestamp, p.Topic, headers, payload, iid, p.ParkedAt)
	if err != nil {
		return false, fmt.Errorf("park sequence %d of key %s: %w", p.Seq, textcol.Quote(key), err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("park sequence %d of key %s: read rows affected: %w", p.Seq, textcol.Quote(key), err)
	}
	return n > 0, nil
}

// load returns up to limit parked messages of (handler, key) with sequences above after, in
// sequence order. On MySQL it reads with a locking read, which sees the latest committed rows
// whatever the transaction's snapshot.
func (s *Store) load(ctx context.Context, tx sqlx.ExtContext, handler, key string, after int64, limit int) ([]parkedMsg, error) {
	rows, err := tx.QueryxContext(ctx, s.q.load, handler, key, after, limit)
	if err != nil {
		return nil, fmt.Errorf("read the parked messages of key %s: %w", textcol.Quote(key), err)
	}
	defer rows.Close()
	var out []parkedMsg
	for rows.Next() {
		var p parkedMsg
		var headers sql.NullString
		if err := rows.Scan(&p.Seq, &p.MessageID, &p.Timestamp, &p.Topic, &headers, &p.Payload, &p.InternalID,
			&p.ParkedAt, &p.Attempts, &p.LastError); err != nil {
			return nil, fmt.Errorf("read the parked messages of key %s: %w", textcol.Quote(key), err)
		}
		if headers.Valid {
			p.Headers = []byte(headers.String)
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the parked messages of key %s: %w", textcol.Quote(key), err)
	}
	return out, rows.Close()
}

// deleteRange deletes the parked messages of (handler, key) with sequences in (after, upTo].
func (s *Store) deleteRange(ctx context.Context, tx sqlx.ExtContext, handler, key string, after, upTo int64) error {
	if _, err := tx.ExecContext(ctx, s.q.deleteRange, handler, key, after, upTo); err != nil {
		return fmt.Errorf("delete the applied parked messages of key %s: %w", textcol.Quote(key), err)
	}
	return nil
}

// deleteOne deletes one parked message, if it is still there, and reports whether it was.
func (s *Store) deleteOne(ctx context.Context, tx sqlx.ExtContext, handler, key string, seq int64, id string) (bool, error) {
	res, err := tx.ExecContext(ctx, s.q.deleteOne, handler, key, seq, id)
	if err != nil {
		return false, fmt.Errorf("delete parked sequence %d of key %s: %w", seq, textcol.Quote(key), err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("delete parked sequence %d of key %s: read rows affected: %w", seq, textcol.Quote(key), err)
	}
	return n > 0, nil
}

// fail records a failed attempt to apply a parked message.
func (s *Store) fail(ctx context.Context, tx sqlx.ExtContext, handler, key string, seq int64, cause error, at int64) error {
	text := cleanText(cause.Error())
	if _, err := tx.ExecContext(ctx, s.q.fail, text, at, handler, key, seq); err != nil {
		return fmt.Errorf("record the failure of parked sequence %d of key %s: %w", seq, textcol.Quote(key), err)
	}
	return nil
}

// skip records that the sequences from..to of (handler, key) were given up on.
func (s *Store) skip(ctx context.Context, tx sqlx.ExtContext, handler, key string, from, to int64, reason string, at int64) error {
	reason = cleanText(reason)
	if _, err := tx.ExecContext(ctx, s.q.skip, handler, key, from, to, reason, at); err != nil {
		return fmt.Errorf("record skipped sequences %d..%d of key %s: %w", from, to, textcol.Quote(key), err)
	}
	return nil
}

// Skipped is a range of sequences of one key that a gap policy gave up on.
type Skipped struct {
	From, To  uint64
	Reason    string
	SkippedAt time.Time
}

// skippedAt returns the skipped range that holds seq, if any.
func (s *Store) skippedAt(ctx context.Context, tx sqlx.ExtContext, handler, key string, seq int64) (Skipped, bool, error) {
	var from, to, at int64
	var sk Skipped
	err := tx.QueryRowxContext(ctx, s.q.skippedAt, handler, key, seq, seq).Scan(&from, &to, &sk.Reason, &at)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return sk, false, nil
	case err != nil:
		return sk, false, fmt.Errorf("look up skipped sequence %d of key %s: %w", seq, textcol.Quote(key), err)
	}
	sk.From, sk.To, sk.SkippedAt = uint64(from), uint64(to), time.UnixMicro(at)
	return sk, true, nil
}

// blockedKey is a key the sweeper looks at, and since when it waits.
type blockedKey struct {
	Key     string `db:"order_key"`
	Blocked int64  `db:"blocked_since"`
}

// blockedKeys runs one page of a key query (stalledKeys or overdueKeys).
func (s *Store) blockedKeys(ctx context.Context, query string, args ...any) ([]blockedKey, error) {
	var keys []blockedKey
	if err := s.db.SelectContext(ctx, &keys, query, args...); err != nil {
		return nil, err
	}
	return keys, nil
}

// checkKey returns an error wrapping ErrInvalidKey when handler or key cannot be stored.
func checkKey(handler, key string) error {
	if err := checkText("handler name", handler, MaxHandlerLen); err != nil {
		return err
	}
	return checkText("ordering key", key, MaxKeyLen)
}

func checkText(what, v string, maxLen int) error {
	if v == "" {
		return fmt.Errorf("%w: %s is empty", ErrInvalidKey, what)
	}
	switch fault, n := textcol.Check(v, maxLen); fault {
	case textcol.TooLong:
		return fmt.Errorf("%w: %s %s has %d characters, more than %d", ErrInvalidKey, what, textcol.Quote(v), n, maxLen)
	case textcol.NotUTF8:
		return fmt.Errorf("%w: %s %s is not valid UTF-8", ErrInvalidKey, what, textcol.Quote(v))
	case textcol.NUL:
		return fmt.Errorf("%w: %s %s contains a NUL byte", ErrInvalidKey, what, textcol.Quote(v))
	}
	return nil
}

// cleanText makes an error text storable in a text column of every dialect: at most
// maxErrorLen bytes of valid UTF-8 without NUL bytes.
func cleanText(s string) string {
	if len(s) > maxErrorLen {
		s = s[:maxErrorLen]
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, ""), "\x00", "")
}
