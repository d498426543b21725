package dedup

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jmoiron/sqlx"
)

// This file records many keys at once: a group's ids in as few statements as the dialect allows,
// and the outcome of each.

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
// usable: on PostgreSQL an INSERT over arrays of the keys (one statement text for every batch
// size) that returns only the duplicates and renewals; elsewhere a multi-row INSERT (on
// MariaDB 10.5 and later returning every row; on MySQL, which lacks INSERT ... RETURNING,
// followed by at most one SELECT of the rows it wrote; on SQLite preceded by one read of the
// largest rowid, which tells a renewed row from a new one). Keys are written in a fixed order,
// so that concurrent batches sharing keys wait for each other rather than deadlock; a deadlock or
// serialization failure that happens all the same is retryable (sqldb.Conflict). An invalid key
// anywhere in keys fails the whole call before any statement runs; the error names its
// position.
func (s *SQLStore) RecordKeys(ctx context.Context, tx sqlx.ExtContext, keys []Key) ([]Outcome, error) {
	return s.recordKeys(ctx, tx, keys, false)
}

// TryRecordKeys is RecordKeys for a transaction that its caller can run again, and that is
// expected to find every key new: it inserts the keys not recorded yet with a plain multi-row
// INSERT, whose count of rows says whether that was all of them. It reads no rows and leaves
// expired records alone, which costs the database less than RecordKeys' statement, and on
// PostgreSQL the statement, first in its transaction, goes out with the transaction's BEGIN on
// a database opened by sqldb.Open. It returns nil outcomes when a key was recorded already,
// expired or not: then what it wrote must not commit; roll tx back, and record the keys with
// RecordKeys in a new transaction.
func (s *SQLStore) TryRecordKeys(ctx context.Context, tx sqlx.ExtContext, keys []Key) ([]Outcome, error) {
	fresh, err := s.recordKeys(ctx, tx, keys, true)
	if errors.Is(err, errNotAllNew) {
		return nil, nil
	}
	return fresh, err
}

// errNotAllNew is TryRecordKeys' finding that a key was not simply recorded.
var errNotAllNew = errors.New("a key is not new")

func (s *SQLStore) recordKeys(ctx context.Context, tx sqlx.ExtContext, keys []Key, try bool) ([]Outcome, error) {
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
	at := order[:0] // the position in keys of each distinct key, written over order as it is read
	for _, i := range order {
		if len(at) > 0 && keys[at[len(at)-1]] == keys[i] {
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
		if err := s.recordChunk(ctx, tx, chunk, pos, fresh, created, expires, try); errors.Is(err, errNotAllNew) {
			return nil, err
		} else if err != nil {
			return nil, fmt.Errorf("dedup: record %d keys in %s: %w", len(chunk), s.table, err)
		}
	}
	return fresh, nil
}

// recordChunk records chunk (distinct, valid, sorted) and sets fresh at pos, the positions of
// chunk's keys, for those it recorded. With try, it records only keys that are new, and returns
// errNotAllNew when some were not.
func (s *SQLStore) recordChunk(ctx context.Context, tx sqlx.ExtContext, chunk []Key, pos []int, fresh []Outcome, created, expires int64, try bool) error {
	if fr, ok := s.dialect.(freshRecorder); ok && try {
		switch allNew, err := fr.recordIfNew(ctx, tx, chunk, created, expires); {
		case err != nil:
			return err
		case !allNew:
			return errNotAllNew
		}
		for _, i := range pos {
			fresh[i] = Recorded
		}
		return nil
	}
	if er, ok := s.dialect.(exceptionRecorder); ok {
		for _, i := range pos {
			fresh[i] = Recorded
		}
		exceptions, err := er.recordExceptions(ctx, tx, chunk, created, expires)
		if err != nil {
			return err
		}
		for _, e := range exceptions {
			if e.index < 0 || e.index >= len(chunk) {
				return fmt.Errorf("the database returned position %d, which is not in the batch", e.index+1)
			}
			fresh[pos[e.index]] = e.outcome
		}
		return nil
	}
	mr, ok := s.dialect.(manyRecorder)
	if !ok {
		return fmt.Errorf("the %T dialect records no batch of keys", s.dialect)
	}
	recorded, err := mr.recordMany(ctx, tx, chunk, created, expires)
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

// A dialect records a batch of keys either as a manyRecorder or as an exceptionRecorder: MySQL
// and SQLite the first way, PostgreSQL the second.
var (
	_ manyRecorder      = (*mysql)(nil)
	_ manyRecorder      = (*sqlite)(nil)
	_ exceptionRecorder = (*postgres)(nil)
	_ freshRecorder     = (*mysql)(nil)
	_ freshRecorder     = (*sqlite)(nil)
	_ freshRecorder     = (*postgres)(nil)
)

// manyRecorder is a dialect that records a batch of keys with one multi-row statement returning
// the keys it recorded.
type manyRecorder interface {
	// recordMany records keys (distinct, valid, at most maxKeysPerStatement) in tx with one
	// multi-row statement, plus at most one other statement, and returns those it recorded,
	// each with whether it replaced an expired record.
	recordMany(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (map[Key]bool, error)
}

// exceptionRecorder is a dialect that records a batch of keys with one statement returning only
// the keys that were not simply recorded: duplicates and renewed expired records.
type exceptionRecorder interface {
	// recordExceptions records keys (distinct, valid, sorted) in tx and returns the keys,
	// by index into keys, that it did not record as new: Duplicate or Renewed.
	recordExceptions(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) ([]exception, error)
}

// freshRecorder is a dialect that records a batch of keys expected to be new with a plain
// multi-row insert, whose count of rows written says whether they were (TryRecordKeys).
type freshRecorder interface {
	// recordIfNew records the keys (distinct, valid, sorted) that are not recorded yet, expired
	// or not, and reports whether that was every one of them; when it was not, what it wrote
	// must not commit.
	recordIfNew(ctx context.Context, tx sqlx.ExtContext, keys []Key, created, expires int64) (bool, error)
}

// exception is a key of a batch that was not recorded as new.
type exception struct {
	index   int
	outcome Outcome
}

func compareKeys(a, b Key) int {
	return cmp.Or(strings.Compare(a.Handler, b.Handler), strings.Compare(a.MessageID, b.MessageID), cmp.Compare(a.Timestamp, b.Timestamp))
}

// rowArgs returns the arguments of a multi-row insert of keys, five to a row (handler,
// message_id, message_ts, created_at, expires_at), with room for one more.
func rowArgs(keys []Key, created, expires int64) []any {
	args := make([]any, 0, 5*len(keys)+1)
	c, e := any(created), any(expires) // boxed once for every row
	var handler any
	for i, k := range keys {
		if i == 0 || k.Handler != keys[i-1].Handler {
			handler = k.Handler // boxed once for a run of keys of one handler, a group's
		}
		args = append(args, handler, k.MessageID, k.Timestamp, c, e)
	}
	return args
}

// repeatRows returns prefix, then row n times separated by commas, then suffix: the text of a
// multi-row statement whose placeholders are anonymous.
func repeatRows(prefix, row, suffix string, n int) string {
	var b strings.Builder
	b.Grow(len(prefix) + n*(len(row)+1) + len(suffix))
	b.WriteString(prefix)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(row)
	}
	b.WriteString(suffix)
	return b.String()
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
	// One row's destinations serve every row: the map takes a copy of each key.
	var k Key
	var renewed bool
	dest := []any{&k.Handler, &k.MessageID, &k.Timestamp, &renewed}
	if !flagged {
		dest = dest[:3]
	}
	for rows.Next() {
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
