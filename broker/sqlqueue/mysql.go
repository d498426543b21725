package sqlqueue

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

// mysql is the queue in MySQL or MariaDB: watermill-sql's DefaultMySQLSchema, whose offsets are
// AUTO_INCREMENT, and the group's cursor is offset_acked.
//
// A claim reads the messages after the cursor with a locking read (LOCK IN SHARE MODE), as
// watermill-sql's SERIALIZABLE subscribe does (see Visibility order in the package
// documentation). Claims run at READ COMMITTED, where InnoDB locks the rows it reads and not the
// gaps between them, so publishers are never held up by a claim. FOR UPDATE SKIP LOCKED needs
// MySQL 8.0 or MariaDB 10.6.
type mysql struct {
	names func(topic string) Tables
	// gapWait is Config.GapWait.
	gapWait time.Duration
}

func (m mysql) tables(topic string) Tables { return m.names(topic).quoted("`") }

func (m mysql) ackInTx(topic string) string {
	return "DELETE FROM " + m.tables(topic).Leases + " WHERE consumer_group = ? AND `offset` = ? AND deliveries = ?"
}

func (m mysql) messagesSchema() wsql.SchemaAdapter {
	return wsql.DefaultMySQLSchema{
		GenerateMessagesTableName: func(topic string) string { return m.tables(topic).Messages },
		GeneratePayloadType:       func(string) string { return "LONGBLOB" },
	}
}

func (m mysql) schema(topic string) []wsql.Query {
	t := m.tables(topic)
	offsets := wsql.DefaultMySQLOffsetsAdapter{GenerateMessagesOffsetsTableName: func(string) string { return t.Offsets }}
	stmts := append(m.messagesSchema().SchemaInitializingQueries(topic), offsets.SchemaInitializingQueries(topic)...)
	return append(stmts, wsql.Query{Query: "CREATE TABLE IF NOT EXISTS " + t.Leases + ` (
			consumer_group VARCHAR(255) NOT NULL,
			` + "`offset`" + ` BIGINT NOT NULL,
			deliveries INT NOT NULL,
			visible_at DATETIME(6) NOT NULL,
			PRIMARY KEY (consumer_group, ` + "`offset`" + `),
			KEY due (consumer_group, visible_at)
		)`})
}

// keys' Insert leaves an existing row as it is, which MySQL reports as 0 rows affected.
func (mysql) keys() dbqueue.DeadLetterKeys {
	return dbqueue.DeadLetterKeys{
		Schema: "CREATE TABLE IF NOT EXISTS " + DeadLetterKeysTable + ` (
			topic           VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
			dead_letter_key VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
			published_at    BIGINT NOT NULL,
			PRIMARY KEY (topic, dead_letter_key)
		) ENGINE=InnoDB`,
		Delete: "DELETE FROM " + DeadLetterKeysTable + " WHERE published_at < ?",
		Insert: "INSERT INTO " + DeadLetterKeysTable + ` (topic, dead_letter_key, published_at) VALUES (?, ?, ?)
ON DUPLICATE KEY UPDATE topic = topic`,
	}
}

func (m mysql) addGroup(ctx context.Context, db *sql.DB, topic, group string) error {
	// Look before writing: an upsert of the row would wait for a consumer that holds it.
	if known, err := m.hasGroup(ctx, db, topic, group); err != nil || known {
		return err
	}
	_, err := db.ExecContext(ctx, "INSERT INTO "+m.tables(topic).Offsets+" (consumer_group, offset_acked, offset_consumed) VALUES (?, 0, 0) "+
		"ON DUPLICATE KEY UPDATE consumer_group = consumer_group", group)
	return err
}

// myNow is the database's clock in UTC, the time of visible_at.
const myNow = "UTC_TIMESTAMP(6)"

func (m mysql) probe(ctx context.Context, db *sql.DB, topic, group string) (due, fresh bool, err error) {
	t := m.tables(topic)
	err = db.QueryRowContext(ctx, "SELECT "+
		"EXISTS (SELECT 1 FROM "+t.Leases+" WHERE consumer_group = ? AND visible_at <= "+myNow+"), "+
		"EXISTS (SELECT 1 FROM "+t.Messages+" WHERE `offset` > COALESCE((SELECT offset_acked FROM "+t.Offsets+" WHERE consumer_group = ?), 0))",
		group, group).Scan(&due, &fresh)
	return due, fresh, err
}

func (m mysql) claimDue(ctx context.Context, db *sql.DB, topic, group string, n int, lease time.Duration) ([]row, error) {
	t := m.tables(topic)
	var out []row
	err := inTx(ctx, db, func(tx *sql.Tx) error {
		rows, err := tx.QueryContext(ctx, "SELECT `offset` FROM "+t.Leases+
			" WHERE consumer_group = ? AND visible_at <= "+myNow+" ORDER BY visible_at LIMIT ? FOR UPDATE SKIP LOCKED", group, n)
		due, err := dbqueue.Rows(rows, err, func(offset *int64) []any { return []any{offset} })
		if err != nil || len(due) == 0 {
			return err
		}
		args := []any{lease.Microseconds(), group}
		for _, offset := range due {
			args = append(args, offset)
		}
		in := dbqueue.Marks(len(due))
		if _, err := tx.ExecContext(ctx, "UPDATE "+t.Leases+" SET deliveries = deliveries + 1, visible_at = "+myNow+" + INTERVAL ? MICROSECOND"+
			" WHERE consumer_group = ? AND `offset` IN "+in, args...); err != nil {
			return err
		}
		rows, err = tx.QueryContext(ctx, "SELECT l.`offset`, l.deliveries, m.`uuid` IS NULL, COALESCE(m.`uuid`, ''), m.`payload`, m.`metadata` FROM "+
			t.Leases+" l LEFT JOIN "+t.Messages+" m ON m.`offset` = l.`offset` WHERE l.consumer_group = ? AND l.`offset` IN "+in+" ORDER BY l.`offset`", args[1:]...)
		out, err = dbqueue.Rows(rows, err, func(r *row) []any {
			return []any{&r.offset, &r.deliveries, &r.orphan, &r.uuid, &r.payload, &r.metadata}
		})
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (m mysql) claimNew(ctx context.Context, db *sql.DB, topic, group string, n int, lease time.Duration) (out []row, err error) {
	t := m.tables(topic)
	err = inTx(ctx, db, func(tx *sql.Tx) error {
		// The group's cursor row serialises its claims; a consumer that finds it locked leaves
		// new messages to the one that holds it this round, rather than wait.
		var cursor int64
		switch err := tx.QueryRowContext(ctx, "SELECT COALESCE(offset_acked, 0) FROM "+t.Offsets+
			" WHERE consumer_group = ? FOR UPDATE SKIP LOCKED", group).Scan(&cursor); {
		case errors.Is(err, sql.ErrNoRows):
			return nil
		case err != nil:
			return err
		}
		// The locking read waits for a lower offset that a running transaction inserted; an
		// offset allocated and not yet written is a gap (Config.GapWait).
		rows, err := tx.QueryContext(ctx, "SELECT `offset`, `uuid`, `payload`, `metadata`, "+
			"`created_at` <= NOW(6) - INTERVAL ? MICROSECOND FROM "+t.Messages+
			" WHERE `offset` > ? ORDER BY `offset` LIMIT ? LOCK IN SHARE MODE", m.gapWait.Microseconds(), cursor, n)
		batch, err := dbqueue.Rows(rows, err, func(r *row) []any {
			r.deliveries = 1
			return []any{&r.offset, &r.uuid, &r.payload, &r.metadata, &r.settled}
		})
		if err != nil {
			return err
		}
		batch = consecutive(batch, cursor)
		if len(batch) == 0 {
			return nil
		}
		values := make([]string, len(batch))
		args := make([]any, 0, 3*len(batch))
		for i, r := range batch {
			values[i] = "(?, ?, 1, " + myNow + " + INTERVAL ? MICROSECOND)"
			args = append(args, group, r.offset, lease.Microseconds())
		}
		if _, err := tx.ExecContext(ctx, "INSERT INTO "+t.Leases+" (consumer_group, `offset`, deliveries, visible_at) VALUES "+
			strings.Join(values, ", "), args...); err != nil {
			return err
		}
		last := batch[len(batch)-1].offset
		if _, err := tx.ExecContext(ctx, "UPDATE "+t.Offsets+" SET offset_acked = ?, offset_consumed = ? WHERE consumer_group = ?",
			last, last, group); err != nil {
			return err
		}
		out = batch
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (m mysql) settle(ctx context.Context, db *sql.DB, topic, group string, b *batch) error {
	t := m.tables(topic)
	// A settlement matches its lease only while the deliveries count is the one its delivery
	// had. The IN list of offsets lets InnoDB go by the primary key.
	match := func(refs []leaseRef) (string, []any) {
		offsets := make([]any, len(refs))
		pairs := make([]any, 0, 2*len(refs))
		for i, r := range refs {
			offsets[i] = r.offset
			pairs = append(pairs, r.offset, r.deliveries)
		}
		return "consumer_group = ? AND `offset` IN " + dbqueue.Marks(len(refs)) +
				" AND (`offset`, deliveries) IN (" + strings.TrimSuffix(strings.Repeat("(?, ?), ", len(refs)), ", ") + ")",
			append(append([]any{group}, offsets...), pairs...)
	}
	var stmts []string
	var args [][]any
	if len(b.acks) > 0 {
		where, a := match(b.acks)
		stmts = append(stmts, "DELETE FROM "+t.Leases+" WHERE "+where)
		args = append(args, a)
	}
	if len(b.updates) > 0 {
		refs := make([]leaseRef, len(b.updates))
		var delayArgs, deltaArgs []any
		for i, u := range b.updates {
			refs[i] = u.leaseRef
			delayArgs = append(delayArgs, u.offset, u.deliveries, u.delay.Microseconds())
			deltaArgs = append(deltaArgs, u.offset, u.deliveries, u.delta)
		}
		when := strings.Repeat(" WHEN `offset` = ? AND deliveries = ? THEN ?", len(refs))
		where, a := match(refs)
		// MySQL assigns left to right: visible_at is computed before deliveries changes.
		stmts = append(stmts, "UPDATE "+t.Leases+" SET visible_at = "+myNow+" + INTERVAL (CASE"+when+" ELSE 0 END) MICROSECOND,"+
			" deliveries = deliveries + (CASE"+when+" ELSE 0 END) WHERE "+where)
		args = append(args, append(append(delayArgs, deltaArgs...), a...))
	}
	if len(stmts) == 1 {
		_, err := db.ExecContext(ctx, stmts[0], args[0]...)
		return err
	}
	return inTx(ctx, db, func(tx *sql.Tx) error {
		for i, s := range stmts {
			if _, err := tx.ExecContext(ctx, s, args[i]...); err != nil {
				return err
			}
		}
		return nil
	})
}

func (m mysql) waiting(ctx context.Context, db *sql.DB, topic, group string, have tableSet, limit int) ([]row, error) {
	t := m.tables(topic)
	cursor := "0"
	if have.offsets {
		cursor = "COALESCE((SELECT offset_acked FROM " + t.Offsets + " WHERE consumer_group = ?), 0)"
	}
	// Leases are at or below the cursor: ordering the union by offset lists them first.
	query := "SELECT `offset`, 0 AS deliveries, 0 AS leased, `uuid`, `payload`, `metadata` FROM " + t.Messages + " WHERE `offset` > " + cursor
	var args []any
	if have.offsets {
		args = append(args, group)
	}
	if have.leases {
		query += " UNION ALL SELECT m.`offset`, l.deliveries, 1, m.`uuid`, m.`payload`, m.`metadata` FROM " + t.Leases + " l JOIN " +
			t.Messages + " m ON m.`offset` = l.`offset` WHERE l.consumer_group = ?"
		args = append(args, group)
	}
	rows, err := db.QueryContext(ctx, "SELECT * FROM ("+query+") AS waiting ORDER BY `offset` LIMIT ?", append(args, limit)...)
	return dbqueue.Rows(rows, err, func(r *row) []any {
		return []any{&r.offset, &r.deliveries, &r.leased, &r.uuid, &r.payload, &r.metadata}
	})
}

func (m mysql) existing(ctx context.Context, db *sql.DB, topic string) (have tableSet, err error) {
	n := m.names(topic)
	// BINARY: the names are compared byte for byte, as the server's file names are.
	exists := "EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = DATABASE() AND BINARY table_name = ?)"
	err = db.QueryRowContext(ctx, "SELECT "+exists+", "+exists+", "+exists, n.Messages, n.Offsets, n.Leases).
		Scan(&have.messages, &have.offsets, &have.leases)
	return have, err
}

func (m mysql) remove(ctx context.Context, db *sql.DB, topic string, have tableSet, r row) error {
	t := m.tables(topic)
	return inTx(ctx, db, func(tx *sql.Tx) error {
		if have.leases {
			if _, err := tx.ExecContext(ctx, "DELETE FROM "+t.Leases+" WHERE `offset` = ?", r.offset); err != nil {
				return err
			}
		}
		_, err := tx.ExecContext(ctx, "DELETE FROM "+t.Messages+" WHERE `offset` = ?", r.offset)
		return err
	})
}

// consecutive returns the rows of batch (in offset order) that follow cursor without a gap,
// except a gap before a settled row. (created_at is compared in the session's time zone, as a
// TIMESTAMP column is.)
func consecutive(batch []row, cursor int64) []row {
	next := cursor + 1
	for i, r := range batch {
		if r.offset != next && !r.settled {
			return batch[:i]
		}
		next = r.offset + 1
	}
	return batch
}

func (m mysql) hasGroup(ctx context.Context, db *sql.DB, topic, group string) (bool, error) {
	var n int
	err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+m.tables(topic).Offsets+" WHERE consumer_group = ?", group).Scan(&n)
	return n > 0, err
}

func (m mysql) trim(ctx context.Context, db *sql.DB, topic string, have tableSet, limit int) (int64, error) {
	t := m.tables(topic)
	// The message at the highest offset stays: MySQL 5.7 takes the next AUTO_INCREMENT value
	// from the highest row at a restart, and an empty table would hand out offsets below the
	// cursors again.
	var last sql.NullInt64
	if err := db.QueryRowContext(ctx, "SELECT MAX(`offset`) FROM "+t.Messages).Scan(&last); err != nil || !last.Valid {
		return 0, err
	}
	leased := ""
	if have.leases {
		leased = " AND `offset` NOT IN (SELECT `offset` FROM " + t.Leases + ")"
	}
	// A claim moves the group's cursor and leases what it passes in one transaction.
	return dbqueue.Affected(db.ExecContext(ctx, "DELETE FROM "+t.Messages+" WHERE `offset` < ? AND `offset` <= (SELECT MIN(COALESCE(offset_acked, 0)) FROM "+
		t.Offsets+")"+leased+" ORDER BY `offset` LIMIT ?", last.Int64, limit))
}
