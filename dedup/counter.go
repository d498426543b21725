package dedup

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqllock"
	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/sqldb"
)

// DefaultCounterTable is the table of a Counter whose CounterConfig names none.
const DefaultCounterTable = "onceflow_deliveries"

// CounterConfig configures a Counter. The zero value is valid.
type CounterConfig struct {
	// Table is the name of the counter table, a plain SQL identifier. Defaults to
	// DefaultCounterTable.
	Table string
	// Retention is how long a count is kept after the message's last delivery. Defaults to
	// DefaultRetention.
	Retention time.Duration
	// Now returns the current time. Defaults to time.Now.
	Now func() time.Time
}

// Counter counts the deliveries of messages durably, for brokers that do not count them (a
// RabbitMQ classic queue says only whether a delivery is the first): the router gives a
// message up at its handler's delivery limit even when every delivery ends with its consumer
// dying, which no count kept in memory survives. A count is written outside any transaction,
// before the message is processed, and only for deliveries the broker does not count itself.
// It is safe for concurrent use.
type Counter struct {
	db        *sqldb.DB
	table     string
	retention time.Duration
	now       func() time.Time
	count     string // handler, message_id, initial, now
	read      string // handler, message_id (MySQL)
	attempt   string // handler, message_id, now
	readTried string // handler, message_id (MySQL)
	group     string // handler, message_id, now
	readGroup string // handler, message_id (MySQL)
	markDead  string // handler, message_id, now
	readDead  string // handler, message_id
	markDone  string // handler, message_id, now
	readDone  string // handler, message_id
	purge     string // before, batch size
}

// NewCounter returns the Counter of db. It does not touch the database: call Migrate first.
func NewCounter(db *sqldb.DB, cfg CounterConfig) (*Counter, error) {
	if db == nil || db.DB == nil {
		return nil, errors.New("dedup.NewCounter: db is nil")
	}
	if cfg.Table != "" {
		if err := sqldb.CheckIdentifier("Table", cfg.Table); err != nil {
			return nil, fmt.Errorf("dedup.NewCounter: %w", err)
		}
	}
	if cfg.Retention < 0 {
		return nil, fmt.Errorf("dedup.NewCounter: Retention: must not be negative, got %s", cfg.Retention)
	}
	c := &Counter{db: db, table: cmp.Or(cfg.Table, DefaultCounterTable), retention: cmp.Or(cfg.Retention, DefaultRetention), now: cfg.Now}
	if c.now == nil {
		c.now = time.Now
	}
	t := db.Dialect.Quote(c.table)
	switch db.Dialect {
	case sqldb.Postgres:
		c.count = `INSERT INTO ` + t + ` AS c (handler, message_id, deliveries, updated_at) VALUES ($1, $2, $3, $4)
ON CONFLICT (handler, message_id) DO UPDATE SET deliveries = GREATEST(c.deliveries + 1, EXCLUDED.deliveries), updated_at = EXCLUDED.updated_at
RETURNING c.deliveries`
		c.attempt, c.group = pgBump(t, "attempts"), pgBump(t, "grouped")
		c.purge = `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + t + ` WHERE updated_at <= $1 LIMIT $2))`
	case sqldb.SQLite:
		c.count = `INSERT INTO ` + t + ` (handler, message_id, deliveries, updated_at) VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (handler, message_id) DO UPDATE SET deliveries = max(deliveries + 1, excluded.deliveries), updated_at = excluded.updated_at
RETURNING deliveries`
		c.attempt, c.group = sqliteBump(t, "attempts"), sqliteBump(t, "grouped")
		c.purge = `DELETE FROM ` + t + ` WHERE rowid IN (SELECT rowid FROM ` + t + ` WHERE updated_at <= ?1 LIMIT ?2)`
	case sqldb.MySQL:
		c.count = `INSERT INTO ` + t + ` (handler, message_id, deliveries, updated_at) VALUES (?, ?, ?, ?)
ON DUPLICATE KEY UPDATE deliveries = GREATEST(deliveries + 1, VALUES(deliveries)), updated_at = VALUES(updated_at)`
		c.read = `SELECT deliveries FROM ` + t + ` WHERE handler = ? AND message_id = ?`
		c.attempt, c.group = mysqlBump(t, "attempts"), mysqlBump(t, "grouped")
		c.readTried = `SELECT attempts FROM ` + t + ` WHERE handler = ? AND message_id = ?`
		c.readGroup = `SELECT grouped FROM ` + t + ` WHERE handler = ? AND message_id = ?`
		c.purge = `DELETE FROM ` + t + ` WHERE updated_at <= ? LIMIT ?`
	default:
		return nil, fmt.Errorf("dedup.NewCounter: db.Dialect: unsupported dialect %q (want postgres, mysql or sqlite)", db.Dialect)
	}
	switch db.Dialect {
	case sqldb.MySQL:
		c.markDead = `INSERT INTO ` + t + ` (handler, message_id, deliveries, dead_lettered, updated_at) VALUES (?, ?, 0, 1, ?)
ON DUPLICATE KEY UPDATE dead_lettered = 1, updated_at = VALUES(updated_at)`
	default:
		c.markDead = db.Rebind(`INSERT INTO ` + t + ` (handler, message_id, deliveries, dead_lettered, updated_at) VALUES (?, ?, 0, 1, ?)
ON CONFLICT (handler, message_id) DO UPDATE SET dead_lettered = 1, updated_at = EXCLUDED.updated_at`)
	}
	c.readDead = db.Rebind(`SELECT dead_lettered FROM ` + t + ` WHERE handler = ? AND message_id = ?`)
	switch db.Dialect {
	case sqldb.MySQL:
		c.markDone = `INSERT INTO ` + t + ` (handler, message_id, deliveries, processed, updated_at) VALUES (?, ?, 0, 1, ?)
ON DUPLICATE KEY UPDATE processed = 1, updated_at = VALUES(updated_at)`
	default:
		c.markDone = db.Rebind(`INSERT INTO ` + t + ` (handler, message_id, deliveries, processed, updated_at) VALUES (?, ?, 0, 1, ?)
ON CONFLICT (handler, message_id) DO UPDATE SET processed = 1, updated_at = EXCLUDED.updated_at`)
	}
	c.readDone = db.Rebind(`SELECT processed FROM ` + t + ` WHERE handler = ? AND message_id = ?`)
	return c, nil
}

// pgBump, sqliteBump and mysqlBump return the statement that adds one to the column col of a
// message's row in the counter table t, creating the row with 1 there; PostgreSQL's and
// SQLite's return the new value.
func pgBump(t, col string) string {
	return `INSERT INTO ` + t + ` AS c (handler, message_id, deliveries, ` + col + `, updated_at) VALUES ($1, $2, 0, 1, $3)
ON CONFLICT (handler, message_id) DO UPDATE SET ` + col + ` = c.` + col + ` + 1, updated_at = EXCLUDED.updated_at
RETURNING c.` + col
}

func sqliteBump(t, col string) string {
	return `INSERT INTO ` + t + ` (handler, message_id, deliveries, ` + col + `, updated_at) VALUES (?1, ?2, 0, 1, ?3)
ON CONFLICT (handler, message_id) DO UPDATE SET ` + col + ` = ` + col + ` + 1, updated_at = excluded.updated_at
RETURNING ` + col
}

func mysqlBump(t, col string) string {
	return `INSERT INTO ` + t + ` (handler, message_id, deliveries, ` + col + `, updated_at) VALUES (?, ?, 0, 1, ?)
ON DUPLICATE KEY UPDATE ` + col + ` = ` + col + ` + 1, updated_at = VALUES(updated_at)`
}

// Table returns the name of the counter's table.
func (c *Counter) Table() string { return c.table }

// Migrate creates the table if it does not exist, and adds the attempts, dead_lettered,
// processed and grouped columns to a table created before they existed. It is idempotent.
func (c *Counter) Migrate(ctx context.Context) error {
	err := createSmallTable(ctx, c.db, c.table, func(idType string) string {
		return `handler    ` + idType + ` NOT NULL,
	message_id ` + idType + ` NOT NULL,
	deliveries INTEGER NOT NULL,
	attempts   INTEGER NOT NULL DEFAULT 0,
	dead_lettered INTEGER NOT NULL DEFAULT 0,
	processed  INTEGER NOT NULL DEFAULT 0,
	grouped    INTEGER NOT NULL DEFAULT 0,
	updated_at BIGINT NOT NULL,
	PRIMARY KEY (handler, message_id)`
	})
	if err != nil {
		return fmt.Errorf("dedup: migrate counter table %s: %w", c.table, err)
	}
	for _, col := range []string{"attempts", "dead_lettered", "processed", "grouped"} {
		if err := c.addColumn(ctx, col); err != nil {
			return fmt.Errorf("dedup: migrate counter table %s: add column %s: %w", c.table, col, err)
		}
	}
	return nil
}

// createSmallTable creates table, whose column list columns returns for the type of its text
// key columns, if it does not exist; on PostgreSQL under an advisory lock, since concurrent
// CREATE TABLE IF NOT EXISTS statements may fail there.
func createSmallTable(ctx context.Context, db *sqldb.DB, table string, columns func(idType string) string) error {
	idType, opts := "VARCHAR(255)", ""
	if db.Dialect == sqldb.MySQL {
		idType = "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
		opts = " ENGINE=InnoDB"
	}
	stmt := `CREATE TABLE IF NOT EXISTS ` + db.Dialect.Quote(table) + ` (
	` + columns(idType) + `
)` + opts
	var lock func(tx *sqlx.Tx) error
	if db.Dialect == sqldb.Postgres {
		lock = func(tx *sqlx.Tx) error {
			_, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgLockKey+`)`, "migrate", table)
			return err
		}
	}
	return sqltx.Exec(ctx, db, []string{stmt}, lock)
}

// addColumn adds the INTEGER column col, 0 by default, to a counter table created before it
// existed. Two processes may both try: the one whose ALTER fails finds the column there.
func (c *Counter) addColumn(ctx context.Context, col string) error {
	t := c.db.Dialect.Quote(c.table)
	has := func() bool {
		rows, err := c.db.QueryContext(ctx, `SELECT `+col+` FROM `+t+` WHERE 1 = 0`)
		if err != nil {
			return false
		}
		return rows.Close() == nil
	}
	if has() {
		return nil
	}
	_, err := c.db.ExecContext(ctx, `ALTER TABLE `+t+` ADD COLUMN `+col+` INTEGER NOT NULL DEFAULT 0`)
	if err != nil && has() {
		return nil
	}
	return err
}

// Count records one more delivery of the message with id for handler and returns how many
// there have been, this one included. A message seen for the first time starts at initial:
// 1 when every delivery is counted, 2 when the first one went uncounted (the broker said it was
// the first). A message whose row holds fewer deliveries than initial (one that MarkDeadLettered,
// Attempt or MarkProcessed wrote for an uncounted first delivery) gets initial too. The write
// is committed when Count returns.
func (c *Counter) Count(ctx context.Context, handler, id string, initial int) (int, error) {
	if err := checkKey(Key{Handler: handler, MessageID: id}); err != nil {
		return 0, err
	}
	now := c.now().UnixMicro()
	if c.read == "" {
		var n int
		if err := c.db.QueryRowxContext(ctx, c.count, handler, id, initial, now).Scan(&n); err != nil {
			return 0, fmt.Errorf("dedup: count a delivery of message %s in %s: %w", textcol.Quote(id), c.table, err)
		}
		return n, nil
	}
	var n int
	err := sqltx.Run(ctx, c.db, func(tx *sqlx.Tx) error {
		if _, err := tx.ExecContext(ctx, c.count, handler, id, initial, now); err != nil {
			return err
		}
		return tx.QueryRowxContext(ctx, c.read, handler, id).Scan(&n)
	})
	if err != nil {
		return 0, fmt.Errorf("dedup: count a delivery of message %s in %s: %w", textcol.Quote(id), c.table, err)
	}
	return n, nil
}

// Attempt records that a delivery of the message with id for handler begins its processing, and
// returns how many of its deliveries have been recorded so: the router records the deliveries
// it runs alone, and a failed one it ran with others, so that a message whose processing kills
// its consumer is told from the messages delivered with it, whose processing never began. The
// write is committed when Attempt returns.
func (c *Counter) Attempt(ctx context.Context, handler, id string) (int, error) {
	return c.bump(ctx, c.attempt, c.readTried, "an attempt", handler, id)
}

// Grouped records a redelivery of the message with id for handler that may run with other
// messages, and returns how many have been recorded so, this one included: the router runs the
// first with others, and those after it alone (Attempt). The write is committed when it
// returns.
func (c *Counter) Grouped(ctx context.Context, handler, id string) (int, error) {
	return c.bump(ctx, c.group, c.readGroup, "a grouped run", handler, id)
}

// bump records what (an attempt, a grouped run) of the message with id for handler with the
// statement stmt, which adds one to a column of its row, and returns the column's new value:
// from stmt itself, or read by read in the same transaction (MySQL).
func (c *Counter) bump(ctx context.Context, stmt, read, what, handler, id string) (int, error) {
	if err := checkKey(Key{Handler: handler, MessageID: id}); err != nil {
		return 0, err
	}
	now := c.now().UnixMicro()
	var n int
	var err error
	if read == "" {
		err = c.db.QueryRowxContext(ctx, stmt, handler, id, now).Scan(&n)
	} else {
		err = sqltx.Run(ctx, c.db, func(tx *sqlx.Tx) error {
			if _, err := tx.ExecContext(ctx, stmt, handler, id, now); err != nil {
				return err
			}
			return tx.QueryRowxContext(ctx, read, handler, id).Scan(&n)
		})
	}
	if err != nil {
		return 0, fmt.Errorf("dedup: record %s of message %s in %s: %w", what, textcol.Quote(id), c.table, err)
	}
	return n, nil
}

// MarkDeadLettered records that the message with id for handler was published to the
// dead-letter topic, so that a redelivery of it (its acknowledgement was lost) is not
// published there again. The write is committed when it returns.
func (c *Counter) MarkDeadLettered(ctx context.Context, handler, id string) error {
	if err := checkKey(Key{Handler: handler, MessageID: id}); err != nil {
		return err
	}
	if _, err := c.db.ExecContext(ctx, c.markDead, handler, id, c.now().UnixMicro()); err != nil {
		return fmt.Errorf("dedup: record the dead letter of message %s in %s: %w", textcol.Quote(id), c.table, err)
	}
	return nil
}

// DeadLettered reports whether MarkDeadLettered recorded the message with id for handler.
func (c *Counter) DeadLettered(ctx context.Context, handler, id string) (bool, error) {
	if err := checkKey(Key{Handler: handler, MessageID: id}); err != nil {
		return false, err
	}
	var n int
	err := c.db.QueryRowxContext(ctx, c.readDead, handler, id).Scan(&n)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("dedup: look up the dead letter of message %s in %s: %w", textcol.Quote(id), c.table, err)
	}
	return n > 0, nil
}

// MarkProcessed records that a delivery of the message with id for handler was processed and
// committed, for a handler without duplicate detection: a later delivery of the message over
// its delivery limit (its acknowledgements were lost) is then acknowledged rather than
// dead-lettered. The write is committed when it returns.
func (c *Counter) MarkProcessed(ctx context.Context, handler, id string) error {
	if err := checkKey(Key{Handler: handler, MessageID: id}); err != nil {
		return err
	}
	if _, err := c.db.ExecContext(ctx, c.markDone, handler, id, c.now().UnixMicro()); err != nil {
		return fmt.Errorf("dedup: record the processing of message %s in %s: %w", textcol.Quote(id), c.table, err)
	}
	return nil
}

// Processed reports whether MarkProcessed recorded the message with id for handler.
func (c *Counter) Processed(ctx context.Context, handler, id string) (bool, error) {
	if err := checkKey(Key{Handler: handler, MessageID: id}); err != nil {
		return false, err
	}
	var n int
	err := c.db.QueryRowxContext(ctx, c.readDone, handler, id).Scan(&n)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("dedup: look up the processing of message %s in %s: %w", textcol.Quote(id), c.table, err)
	}
	return n > 0, nil
}

// Purge deletes the counts of messages last delivered more than Retention ago, in batches, as
// SQLStore.Purge does, and with the same cross-process lock discipline.
func (c *Counter) Purge(ctx context.Context, opts PurgeOptions) (res PurgeResult, err error) {
	if err := opts.Validate(); err != nil {
		return res, fmt.Errorf("dedup: Purge: %w", err)
	}
	release, held, err := sqllock.TryLock(ctx, c.db, c.table+".purge")
	if err != nil {
		return res, fmt.Errorf("dedup: purge %s: take the purge lock: %w", c.table, err)
	}
	if !held {
		return PurgeResult{Skipped: true}, nil
	}
	defer func() {
		if rerr := release(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("dedup: purge %s: release the purge lock: %w", c.table, rerr))
		}
	}()
	before := c.now().Add(-c.retention).UnixMicro()
	res, err = sqldb.PurgeBatches(ctx, opts, func(ctx context.Context, batch int) (int64, error) {
		return c.db.PurgeExec(ctx, c.purge, before, batch)
	})
	if err != nil {
		return res, fmt.Errorf("dedup: purge %s: %w", c.table, err)
	}
	return res, nil
}

// CounterStats describes one handler's rows in the counter table, within its retention.
type CounterStats struct {
	// Redelivered is how many messages were delivered more than once, or had an attempt
	// recorded.
	Redelivered int64
	// DeadLettered is how many messages the handler dead-lettered.
	DeadLettered int64
}

// HandlerStats counts each handler's redelivered and dead-lettered messages. It returns none
// when the table does not exist. It reads the whole table in one statement: call it at the
// pace of a metrics scrape, not per message.
func (c *Counter) HandlerStats(ctx context.Context) (map[string]CounterStats, error) {
	if exists, err := c.db.TableExists(ctx, c.table); err != nil || !exists {
		return map[string]CounterStats{}, err
	}
	rows, err := c.db.QueryContext(ctx, `SELECT handler, COUNT(CASE WHEN deliveries > 1 OR attempts > 0 THEN 1 END), COUNT(CASE WHEN dead_lettered = 1 THEN 1 END) FROM `+
		c.db.Dialect.Quote(c.table)+` GROUP BY handler`)
	if err != nil {
		return nil, fmt.Errorf("dedup: count the deliveries of %s by handler: %w", c.table, err)
	}
	defer rows.Close()
	out := map[string]CounterStats{}
	for rows.Next() {
		var h string
		var st CounterStats
		if err := rows.Scan(&h, &st.Redelivered, &st.DeadLettered); err != nil {
			return nil, fmt.Errorf("dedup: count the deliveries of %s by handler: %w", c.table, err)
		}
		out[h] = st
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dedup: count the deliveries of %s by handler: %w", c.table, err)
	}
	return out, nil
}
