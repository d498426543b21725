package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/sqldb"
)

// The expert baseline is the consumer a strong engineer writes by hand for one broker and one
// database, without a framework, in the strongest form that keeps exactly-once: it takes many
// deliveries at once, applies a batch in one transaction of two multi-row statements, and
// acknowledges the batch after the commit. The ids are recorded in the same transaction as the
// business rows, and a message whose id is recorded already is acknowledged without its effect
// being written again. One file per broker (expert_amqp.go, expert_nats.go, expert_redis.go,
// expert_sqlite.go) holds its consumer; this one the transaction they share.
//
// The transaction takes as few round trips as its statements allow: two. The business insert
// must wait for the ids the id insert returns, and the commit must follow the business insert,
// so the first round trip carries BEGIN and the id insert, the second the business insert and
// COMMIT. On PostgreSQL the statements take arrays ($1::text[], $2::bytea[]), so their text is
// the same for every batch size and pgx prepares each once per connection, and pgx sends each
// pair as one batch on the connection (binary parameters; the simple protocol, which takes
// several statements in one string too, costs far more CPU to carry a 1 KiB payload as text).
// MariaDB has no arrays: each pair is one string of several statements (multiStatements), the
// values interpolated by the driver. SQLite runs in the process: no round trips to save.
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

// expertSQL is the expert's transaction on the cell's database, over a pool of its own: the
// processed-messages table (id primary key; on MariaDB with a batch column) and the business
// table.
type expertSQL struct {
	db                 *sqldb.DB
	processed, effects string
}

// openExpertSQL opens the expert's pool of the database at rawURL, keeping a connection for each
// of its workers; on MariaDB the pool's connections take several statements in one string.
func openExpertSQL(ctx context.Context, rawURL string, tables cellTables, workers int) (*expertSQL, error) {
	if strings.HasPrefix(rawURL, "mysql://") || strings.HasPrefix(rawURL, "mariadb://") {
		u, err := url.Parse(rawURL)
		if err != nil {
			return nil, err
		}
		q := u.Query()
		q.Set("multiStatements", "true")
		u.RawQuery = q.Encode()
		rawURL = u.String()
	}
	db, err := sqldb.Open(ctx, rawURL)
	if err != nil {
		return nil, err
	}
	db.SetMaxIdleConns(workers + 1)
	return &expertSQL{db: db, processed: tables.processed, effects: tables.effects}, nil
}

func (x *expertSQL) close() error { return x.db.Close() }

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
	if x.db.Dialect == sqldb.SQLite {
		return x.applySQLite(ctx, uniq)
	}
	conn, err := x.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if x.db.Dialect == sqldb.MySQL {
		return x.applyMySQL(ctx, conn, uniq)
	}
	var fresh []inMsg
	err = conn.Raw(func(dc any) error {
		c, ok := dc.(interface{ Conn() *pgx.Conn })
		if !ok {
			return fmt.Errorf("a PostgreSQL connection of %T, not pgx's", dc)
		}
		var err error
		fresh, err = x.applyPostgres(ctx, c.Conn(), uniq)
		return err
	})
	return fresh, err
}

// applyPostgres runs the transaction in two batches of pgx, one round trip each: BEGIN and the
// id insert, then the business insert and COMMIT. A failed statement skips the rest of its
// batch, COMMIT included, and the transaction is rolled back.
func (x *expertSQL) applyPostgres(ctx context.Context, c *pgx.Conn, msgs []inMsg) (fresh []inMsg, err error) {
	defer func() {
		if err != nil && c.PgConn().TxStatus() != 'I' {
			// Should the ROLLBACK fail too, the pool discards the connection, which is then
			// still in a transaction.
			_, _ = c.Exec(context.WithoutCancel(ctx), `ROLLBACK`)
		}
	}()
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.id
	}
	var begin pgx.Batch
	begin.Queue(`BEGIN`)
	begin.Queue(`INSERT INTO `+x.processed+` (id) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING RETURNING id`, ids)
	inserted := make(map[string]bool, len(msgs))
	br := c.SendBatch(ctx, &begin)
	if _, err := br.Exec(); err != nil {
		return nil, closeBatch(br, err)
	}
	rows, err := br.Query()
	if err == nil {
		for rows.Next() {
			var id string
			if err = rows.Scan(&id); err != nil {
				break
			}
			inserted[id] = true
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	if err := closeBatch(br, err); err != nil {
		return nil, err
	}

	fresh = freshOf(msgs, inserted)
	var commit pgx.Batch
	if len(fresh) > 0 {
		q, args := effectRows(sqldb.Postgres, x.effects, len(fresh), func(i int) (string, []byte) { return fresh[i].id, fresh[i].payload })
		commit.Queue(q, args...)
	}
	commit.Queue(`COMMIT`)
	br = c.SendBatch(ctx, &commit)
	for range commit.Len() - 1 {
		if _, err := br.Exec(); err != nil {
			return nil, closeBatch(br, err)
		}
	}
	tag, err := br.Exec()
	if err := closeBatch(br, err); err != nil {
		return nil, err
	}
	if tag.String() != "COMMIT" {
		// PostgreSQL answers the COMMIT of a failed transaction with ROLLBACK.
		return nil, fmt.Errorf("COMMIT answered %q", tag)
	}
	return fresh, nil
}

// closeBatch closes the results of a batch and returns the first error: err, or the close's
// (which repeats an error the batch returned already).
func closeBatch(br pgx.BatchResults, err error) error {
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// applyMySQL runs the transaction in two strings of statements, one round trip each: START
// TRANSACTION and the id insert, then the business insert and COMMIT. MariaDB stops a string at
// its first failed statement, COMMIT included, and the transaction is rolled back.
//
// MariaDB has no ON CONFLICT: an upsert that changes nothing on a duplicate key (not INSERT
// IGNORE, which would turn unrelated errors into warnings) writes a token of this transaction
// into the new rows, and RETURNING shows which rows carry it.
func (x *expertSQL) applyMySQL(ctx context.Context, c *sql.Conn, msgs []inMsg) (fresh []inMsg, err error) {
	defer func() {
		if err != nil {
			_, _ = c.ExecContext(context.WithoutCancel(ctx), `ROLLBACK`)
		}
	}()
	token := rand.Int64N(math.MaxInt64) + 1 // never 0, which a NULL batch scans as
	var q strings.Builder
	q.WriteString(`START TRANSACTION; INSERT INTO ` + x.processed + ` (id, batch) VALUES `)
	writeRows(&q, sqldb.MySQL, len(msgs), 2)
	q.WriteString(` ON DUPLICATE KEY UPDATE id = id RETURNING id, batch`)
	args := make([]any, 0, 2*len(msgs))
	for _, m := range msgs {
		args = append(args, m.id, token)
	}
	rows, err := c.QueryContext(ctx, q.String(), args...)
	if err != nil {
		return nil, err
	}
	inserted := make(map[string]bool, len(msgs))
	// The first result is START TRANSACTION's, without rows.
	for more := true; more && err == nil; more = rows.NextResultSet() {
		for err == nil && rows.Next() {
			var id string
			var batch sql.NullInt64
			if err = rows.Scan(&id, &batch); err == nil && batch.Int64 == token {
				inserted[id] = true
			}
		}
	}
	if err := errors.Join(err, rows.Err(), rows.Close()); err != nil {
		return nil, err
	}

	fresh = freshOf(msgs, inserted)
	commit, cargs := `COMMIT`, []any(nil)
	if len(fresh) > 0 {
		commit, cargs = effectRows(sqldb.MySQL, x.effects, len(fresh), func(i int) (string, []byte) { return fresh[i].id, fresh[i].payload })
		commit += `; COMMIT`
	}
	if _, err := c.ExecContext(ctx, commit, cargs...); err != nil {
		return nil, err
	}
	return fresh, nil
}

// applySQLite runs the transaction on the pool's SQLite file: INSERT ... ON CONFLICT DO NOTHING
// RETURNING returns exactly the ids it inserted.
func (x *expertSQL) applySQLite(ctx context.Context, msgs []inMsg) ([]inMsg, error) {
	tx, err := x.db.DB.DB.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	var q strings.Builder
	q.WriteString(`INSERT INTO ` + x.processed + ` (id) VALUES `)
	writeRows(&q, sqldb.SQLite, len(msgs), 1)
	q.WriteString(` ON CONFLICT DO NOTHING RETURNING id`)
	args := make([]any, len(msgs))
	for i, m := range msgs {
		args[i] = m.id
	}
	rows, err := tx.QueryContext(ctx, q.String(), args...)
	if err != nil {
		return nil, err
	}
	inserted := make(map[string]bool, len(msgs))
	for err == nil && rows.Next() {
		var id string
		if err = rows.Scan(&id); err == nil {
			inserted[id] = true
		}
	}
	if err := errors.Join(err, rows.Err(), rows.Close()); err != nil {
		return nil, err
	}
	fresh := freshOf(msgs, inserted)
	if len(fresh) > 0 {
		if err := insertEffects(ctx, tx, sqldb.SQLite, x.effects, len(fresh), func(i int) (string, []byte) {
			return fresh[i].id, fresh[i].payload
		}); err != nil {
			return nil, err
		}
	}
	return fresh, tx.Commit()
}

// freshOf returns the messages of msgs whose ids are in inserted, in their order.
func freshOf(msgs []inMsg, inserted map[string]bool) []inMsg {
	fresh := make([]inMsg, 0, len(inserted))
	for _, m := range msgs {
		if inserted[m.id] {
			fresh = append(fresh, m)
		}
	}
	return fresh
}

// execer is a transaction of database/sql or sqlx.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// insertEffects writes n business rows (message id, payload) with one INSERT (effectRows).
// onceflow's batch processor uses it, and the expert on SQLite.
func insertEffects(ctx context.Context, tx execer, d sqldb.Dialect, table string, n int, row func(i int) (string, []byte)) error {
	q, args := effectRows(d, table, n, row)
	_, err := tx.ExecContext(ctx, q, args...)
	return err
}

// effectRows returns the INSERT that writes n business rows (message id, payload), and its
// arguments: two arrays on PostgreSQL, whose statement is the same text for every n; one
// placeholder per value elsewhere. The expert and onceflow's batch processor write their rows
// with it, so that the two differ in what surrounds the business statement, not in it.
func effectRows(d sqldb.Dialect, table string, n int, row func(i int) (string, []byte)) (string, []any) {
	if d == sqldb.Postgres {
		ids, payloads := make([]string, n), make([][]byte, n)
		for i := range n {
			ids[i], payloads[i] = row(i)
		}
		return `INSERT INTO ` + table + ` (message_id, payload) SELECT * FROM unnest($1::text[], $2::bytea[])`, []any{ids, payloads}
	}
	var q strings.Builder
	q.WriteString(`INSERT INTO ` + table + ` (message_id, payload) VALUES `)
	writeRows(&q, d, n, 2)
	args := make([]any, 0, 2*n)
	for i := range n {
		id, payload := row(i)
		args = append(args, id, payload)
	}
	return q.String(), args
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
