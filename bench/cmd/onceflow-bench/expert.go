package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/sqldb"
)

// The expert baseline is the consumer a strong engineer writes by hand for one broker and one
// database, without a framework, the one the issue measured onceflow against: it takes many
// deliveries at once, applies a batch in one transaction with two multi-row statements, and
// acknowledges the batch after the commit. It is exactly-once too: the ids are recorded in the
// same transaction as the business rows, and a message whose id is recorded is acknowledged
// without its effect being written again. One file per broker (expert_amqp.go, expert_nats.go,
// expert_redis.go, expert_sqlite.go) holds its consumer; this one the transaction they share.
const (
	expertPrefetch = 128                  // deliveries each worker holds unacknowledged
	expertBatch    = 64                   // most messages in one transaction
	expertWait     = 2 * time.Millisecond // longest wait for a batch to fill after its first message
)

// inMsg is a delivery as the expert sees it.
type inMsg struct {
	id      string
	payload []byte
	sent    int64 // publish time in Unix nanoseconds (headerSent); 0 when not sent
}

// expertSQL is the expert's transaction on the cell's database: the processed-messages table
// (id primary key; on MariaDB with a batch column) and the business table.
type expertSQL struct {
	db                 *sql.DB
	dialect            sqldb.Dialect
	processed, effects string
}

func newExpertSQL(db *sqldb.DB, tables cellTables) *expertSQL {
	return &expertSQL{db: db.DB.DB, dialect: db.Dialect, processed: tables.processed, effects: tables.effects}
}

// apply records the ids of msgs and writes the business rows of the new ones, in one
// transaction, and returns the new ones once it has committed. A message whose id is recorded
// already (a redelivery after a commit whose acknowledgement was lost), or that came twice in
// msgs, has no effect written.
func (x *expertSQL) apply(ctx context.Context, msgs []inMsg) ([]inMsg, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	seen := make(map[string]bool, len(msgs))
	uniq := make([]inMsg, 0, len(msgs))
	for _, m := range msgs {
		if !seen[m.id] {
			seen[m.id] = true
			uniq = append(uniq, m)
		}
	}
	tx, err := x.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	fresh, err := x.record(ctx, tx, uniq)
	if err != nil {
		return nil, err
	}
	if len(fresh) > 0 {
		if err := insertEffects(ctx, tx, x.dialect, x.effects, len(fresh), func(i int) (string, []byte) {
			return fresh[i].id, fresh[i].payload
		}); err != nil {
			return nil, err
		}
	}
	return fresh, tx.Commit()
}

// record inserts the ids of msgs (distinct) with one statement and returns the messages whose
// ids it inserted. PostgreSQL and SQLite return exactly those rows from INSERT ... ON CONFLICT
// DO NOTHING RETURNING. MariaDB has no ON CONFLICT: an upsert that changes nothing on a
// duplicate key (not INSERT IGNORE, which would turn unrelated errors into warnings) writes a
// token of this transaction into the new rows, and RETURNING shows which rows carry it.
func (x *expertSQL) record(ctx context.Context, tx *sql.Tx, msgs []inMsg) ([]inMsg, error) {
	var q strings.Builder
	args := make([]any, 0, 2*len(msgs))
	var token int64
	if x.dialect == sqldb.MySQL {
		token = rand.Int64N(math.MaxInt64) + 1 // never 0, which a NULL batch scans as
		q.WriteString(`INSERT INTO ` + x.processed + ` (id, batch) VALUES `)
		writeRows(&q, x.dialect, len(msgs), 2)
		q.WriteString(` ON DUPLICATE KEY UPDATE id = id RETURNING id, batch`)
		for _, m := range msgs {
			args = append(args, m.id, token)
		}
	} else {
		q.WriteString(`INSERT INTO ` + x.processed + ` (id) VALUES `)
		writeRows(&q, x.dialect, len(msgs), 1)
		q.WriteString(` ON CONFLICT DO NOTHING RETURNING id`)
		for _, m := range msgs {
			args = append(args, m.id)
		}
	}
	rows, err := tx.QueryContext(ctx, q.String(), args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	inserted := make(map[string]bool, len(msgs))
	for rows.Next() {
		var id string
		var batch sql.NullInt64
		dest := []any{&id}
		if x.dialect == sqldb.MySQL {
			dest = append(dest, &batch)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		if x.dialect != sqldb.MySQL || batch.Int64 == token {
			inserted[id] = true
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	fresh := make([]inMsg, 0, len(inserted))
	for _, m := range msgs {
		if inserted[m.id] {
			fresh = append(fresh, m)
		}
	}
	return fresh, nil
}

// execer is a transaction of database/sql or sqlx.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// insertEffects writes n business rows (message id, payload) with one INSERT. The expert and
// onceflow's batch processor both use it.
func insertEffects(ctx context.Context, tx execer, d sqldb.Dialect, table string, n int, row func(i int) (string, []byte)) error {
	var q strings.Builder
	q.WriteString(`INSERT INTO ` + table + ` (message_id, payload) VALUES `)
	writeRows(&q, d, n, 2)
	args := make([]any, 0, 2*n)
	for i := range n {
		id, payload := row(i)
		args = append(args, id, payload)
	}
	_, err := tx.ExecContext(ctx, q.String(), args...)
	return err
}

// writeRows writes the placeholders of n rows of cols values: ($1, $2), ($3, $4) on
// PostgreSQL, (?, ?), (?, ?) elsewhere.
func writeRows(b *strings.Builder, d sqldb.Dialect, n, cols int) {
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteByte('(')
		for j := range cols {
			if j > 0 {
				b.WriteString(", ")
			}
			if d == sqldb.Postgres {
				b.WriteByte('$')
				b.WriteString(strconv.Itoa(i*cols + j + 1))
			} else {
				b.WriteByte('?')
			}
		}
		b.WriteByte(')')
	}
}

// collect waits for a first item from in, then takes more until it holds max of them or wait
// has passed since the first: a batch. ok is false when ctx ended or in was closed; the items
// taken then are not returned.
func collect[T any](ctx context.Context, in <-chan T, buf []T, max int, wait time.Duration, timer *time.Timer) (batch []T, ok bool) {
	select {
	case item, open := <-in:
		if !open {
			return nil, false
		}
		buf = append(buf, item)
	case <-ctx.Done():
		return nil, false
	}
	timer.Reset(wait)
	defer timer.Stop()
	for len(buf) < max {
		select {
		case item, open := <-in:
			if !open {
				return nil, false
			}
			buf = append(buf, item)
		case <-timer.C:
			return buf, true
		}
	}
	return buf, true
}

// sentAt parses the publish time of headerSent; 0 when v is not set.
func sentAt(v any) int64 {
	var s string
	switch v := v.(type) {
	case string:
		s = v
	case []byte:
		s = string(v)
	default:
		return 0
	}
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}

// sentAtJSON returns the publish time in the JSON metadata of an SQLite queue row.
func sentAtJSON(metadata string) int64 {
	if !strings.Contains(metadata, headerSent) {
		return 0
	}
	var md map[string]string
	if json.Unmarshal([]byte(metadata), &md) != nil {
		return 0
	}
	return sentAt(md[headerSent])
}

// errNoID reports a delivery the expert cannot deduplicate.
var errNoID = errors.New("message has no id")
