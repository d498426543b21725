package sqlqueue

import (
	"context"
	"database/sql"
	"strconv"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

// postgres is the queue in PostgreSQL: watermill-sql's DefaultPostgreSQLSchema, where each
// message row carries the id of the transaction that wrote it (xid8), and the group's cursor is
// the pair (last_processed_transaction_id, offset_acked).
//
// A claim reads only rows of transactions below pg_snapshot_xmin of the current snapshot, all
// ended, in (transaction_id, offset) order, as watermill-sql's SelectQuery does (see Visibility
// order in the package documentation).
//
// Claims and settlements are single statements, each its own transaction, at the server's
// default isolation, read committed. Under a stricter default (default_transaction_isolation)
// concurrent claims of one group fail with serialization errors now and then, and are run
// again.
type postgres struct {
	names func(topic string) Tables
}

func (p postgres) tables(topic string) Tables { return p.names(topic).quoted(`"`) }

func (p postgres) ackInTx(topic string) string {
	return `DELETE FROM ` + p.tables(topic).Leases + ` WHERE consumer_group = $1 AND "offset" = $2 AND deliveries = $3`
}

func (p postgres) messagesSchema() wsql.SchemaAdapter {
	// The default payload type, JSON, refuses payloads that are not JSON.
	return wsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(topic string) string { return p.tables(topic).Messages },
		GeneratePayloadType:       func(string) string { return "BYTEA" },
	}
}

func (p postgres) schema(topic string) []wsql.Query {
	t := p.tables(topic)
	offsets := wsql.DefaultPostgreSQLOffsetsAdapter{GenerateMessagesOffsetsTableName: func(string) string { return t.Offsets }}
	stmts := append(p.messagesSchema().SchemaInitializingQueries(topic), offsets.SchemaInitializingQueries(topic)...)
	return append(stmts, wsql.Query{Query: `CREATE TABLE IF NOT EXISTS ` + t.Leases + ` (
			consumer_group VARCHAR(255) NOT NULL,
			"offset" BIGINT NOT NULL,
			transaction_id xid8 NOT NULL,
			deliveries INTEGER NOT NULL,
			visible_at TIMESTAMPTZ NOT NULL,
			PRIMARY KEY (consumer_group, "offset")
		)`},
		wsql.Query{Query: `CREATE INDEX IF NOT EXISTS ` + t.DueIndex + ` ON ` + t.Leases + ` (consumer_group, visible_at)`})
}

func (postgres) keys() dbqueue.DeadLetterKeys {
	return dbqueue.DeadLetterKeys{
		Schema: `CREATE TABLE IF NOT EXISTS ` + DeadLetterKeysTable + ` (
			topic           VARCHAR(255) NOT NULL,
			dead_letter_key VARCHAR(64) NOT NULL,
			published_at    BIGINT NOT NULL,
			PRIMARY KEY (topic, dead_letter_key)
		)`,
		Delete: `DELETE FROM ` + DeadLetterKeysTable + ` WHERE published_at < $1`,
		Insert: `INSERT INTO ` + DeadLetterKeysTable + ` (topic, dead_letter_key, published_at) VALUES ($1, $2, $3)
ON CONFLICT (topic, dead_letter_key) DO NOTHING`,
	}
}

func (p postgres) addGroup(ctx context.Context, db *sql.DB, topic, group string) error {
	// ON CONFLICT DO NOTHING does not wait for a consumer that holds the row locked.
	_, err := db.ExecContext(ctx, `INSERT INTO `+p.tables(topic).Offsets+
		` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ($1, 0, '0') ON CONFLICT DO NOTHING`, group)
	return err
}

// pgAfterCursor is the condition "m is after the group's cursor and safe to read", with the
// cursor in the CTE g (no row: no message). The row comparison is an index condition on the
// primary key (transaction_id, "offset"): the scan starts at the cursor and stops at the
// LIMIT, however long the backlog. (watermill-sql spells it as two ranges joined by OR, which
// the planner can only filter on: it reads every row before the cursor.)
const pgAfterCursor = `(m.transaction_id, m."offset") > ((SELECT tx FROM g), (SELECT off FROM g))
		AND m.transaction_id < pg_snapshot_xmin(pg_current_snapshot())`

func (p postgres) probe(ctx context.Context, db *sql.DB, topic, group string) (due, fresh bool, err error) {
	t := p.tables(topic)
	err = db.QueryRowContext(ctx, `WITH g AS (
			SELECT COALESCE(offset_acked, 0) AS off, last_processed_transaction_id AS tx FROM `+t.Offsets+` WHERE consumer_group = $1
		)
		SELECT
			EXISTS (SELECT 1 FROM `+t.Leases+` WHERE consumer_group = $1 AND visible_at <= now()),
			EXISTS (SELECT 1 FROM `+t.Messages+` m WHERE `+pgAfterCursor+`)`, group).Scan(&due, &fresh)
	return due, fresh, err
}

func (p postgres) claimDue(ctx context.Context, db *sql.DB, topic, group string, n int, lease time.Duration) ([]row, error) {
	t := p.tables(topic)
	// One statement: the lock of SKIP LOCKED lasts until it commits, and a lease it claims
	// is no longer due for the next one.
	rows, err := db.QueryContext(ctx, `WITH due AS MATERIALIZED (
			SELECT "offset" FROM `+t.Leases+`
			WHERE consumer_group = $1 AND visible_at <= now()
			ORDER BY visible_at LIMIT $2
			FOR UPDATE SKIP LOCKED
		), claimed AS (
			UPDATE `+t.Leases+` l SET deliveries = l.deliveries + 1, visible_at = now() + $3::bigint * interval '1 microsecond'
			FROM due WHERE l.consumer_group = $1 AND l."offset" = due."offset"
			RETURNING l."offset", l.transaction_id, l.deliveries
		)
		SELECT c."offset", c.transaction_id::text::bigint, c.deliveries, m.uuid IS NULL, COALESCE(m.uuid, ''), m.payload, m.metadata
		FROM claimed c LEFT JOIN `+t.Messages+` m ON m.transaction_id = c.transaction_id AND m."offset" = c."offset"
		ORDER BY c.transaction_id, c."offset"`, group, n, lease.Microseconds())
	return dbqueue.Rows(rows, err, func(r *row) []any {
		return []any{&r.offset, &r.txID, &r.deliveries, &r.orphan, &r.uuid, &r.payload, &r.metadata}
	})
}

func (p postgres) claimNew(ctx context.Context, db *sql.DB, topic, group string, n int, lease time.Duration) ([]row, error) {
	t := p.tables(topic)
	// One statement, committed on its own. The group's cursor row serialises its claims: a
	// consumer that finds it locked claims nothing this round rather than wait (g is empty,
	// and so is batch). When the row changed since the statement's snapshot, FOR UPDATE
	// returns its latest version; batch then reads, in the statement's snapshot, the messages
	// after that cursor of transactions that had ended when the snapshot was taken: all of
	// them are visible, and none was claimed by the change.
	rows, err := db.QueryContext(ctx, `WITH g AS MATERIALIZED (
			SELECT COALESCE(offset_acked, 0) AS off, last_processed_transaction_id AS tx FROM `+t.Offsets+`
			WHERE consumer_group = $1
			FOR UPDATE SKIP LOCKED
		), batch AS MATERIALIZED (
			SELECT m."offset", m.transaction_id, m.uuid, m.payload, m.metadata FROM `+t.Messages+` m
			WHERE `+pgAfterCursor+`
			ORDER BY m.transaction_id, m."offset" LIMIT $2
		), leased AS (
			INSERT INTO `+t.Leases+` (consumer_group, "offset", transaction_id, deliveries, visible_at)
			SELECT $1, "offset", transaction_id, 1, now() + $3::bigint * interval '1 microsecond' FROM batch
		), moved AS (
			UPDATE `+t.Offsets+` SET offset_acked = last."offset", last_processed_transaction_id = last.transaction_id
			FROM (SELECT "offset", transaction_id FROM batch ORDER BY transaction_id DESC, "offset" DESC LIMIT 1) AS last
			WHERE consumer_group = $1
		)
		SELECT "offset", transaction_id::text::bigint, uuid, payload, metadata FROM batch ORDER BY transaction_id, "offset"`,
		group, n, lease.Microseconds())
	return dbqueue.Rows(rows, err, func(r *row) []any {
		r.deliveries = 1
		return []any{&r.offset, &r.txID, &r.uuid, &r.payload, &r.metadata}
	})
}

func (p postgres) settle(ctx context.Context, db *sql.DB, topic, group string, b *batch) error {
	t := p.tables(topic)
	// Empty, not nil: the driver would send nil as NULL.
	ackOff, updOff, updDelay := []int64{}, []int64{}, []int64{}
	ackDlv, updDlv, updDelta := []int32{}, []int32{}, []int32{}
	for _, a := range b.acks {
		ackOff = append(ackOff, a.offset)
		ackDlv = append(ackDlv, int32(a.deliveries))
	}
	for _, u := range b.updates {
		updOff = append(updOff, u.offset)
		updDlv = append(updDlv, int32(u.deliveries))
		updDelay = append(updDelay, u.delay.Microseconds())
		updDelta = append(updDelta, int32(u.delta))
	}
	// One statement, one commit. A settlement matches its lease only while the deliveries
	// count is the one its delivery had.
	_, err := db.ExecContext(ctx, `WITH acked AS (
			DELETE FROM `+t.Leases+` l USING unnest($2::bigint[], $3::int[]) AS a(o, d)
			WHERE l.consumer_group = $1 AND l."offset" = a.o AND l.deliveries = a.d
		)
		UPDATE `+t.Leases+` l SET visible_at = now() + u.us * interval '1 microsecond', deliveries = l.deliveries + u.dd
		FROM unnest($4::bigint[], $5::int[], $6::bigint[], $7::int[]) AS u(o, d, us, dd)
		WHERE l.consumer_group = $1 AND l."offset" = u.o AND l.deliveries = u.d`,
		group, ackOff, ackDlv, updOff, updDlv, updDelay, updDelta)
	return err
}

func (p postgres) waiting(ctx context.Context, db *sql.DB, topic, group string, have tableSet, limit int) ([]row, error) {
	t := p.tables(topic)
	// Without the group's row, its cursor is the start. Leases are at or below the cursor:
	// ordering the union by (transaction_id, offset) lists them first.
	cursor := `g AS (SELECT '0'::xid8 AS tx, 0::bigint AS off, $1::text AS unused_group)`
	if have.offsets {
		cursor = `g AS (SELECT
			COALESCE((SELECT last_processed_transaction_id FROM ` + t.Offsets + ` WHERE consumer_group = $1), '0') AS tx,
			COALESCE((SELECT offset_acked FROM ` + t.Offsets + ` WHERE consumer_group = $1), 0) AS off)`
	}
	query := `SELECT m."offset", m.transaction_id, 0, false, m.uuid, m.payload, m.metadata FROM ` + t.Messages + ` m
		WHERE (m.transaction_id, m."offset") > ((SELECT tx FROM g), (SELECT off FROM g))`
	if have.leases {
		query += `
		UNION ALL
		SELECT m."offset", m.transaction_id, l.deliveries, true, m.uuid, m.payload, m.metadata
		FROM ` + t.Leases + ` l JOIN ` + t.Messages + ` m ON m.transaction_id = l.transaction_id AND m."offset" = l."offset"
		WHERE l.consumer_group = $1`
	}
	rows, err := db.QueryContext(ctx, `WITH `+cursor+`
		SELECT "offset", transaction_id::text::bigint, deliveries, leased, uuid, payload, metadata
		FROM (`+query+`) AS waiting("offset", transaction_id, deliveries, leased, uuid, payload, metadata)
		ORDER BY transaction_id, "offset" LIMIT $2`, group, limit)
	return dbqueue.Rows(rows, err, func(r *row) []any {
		return []any{&r.offset, &r.txID, &r.deliveries, &r.leased, &r.uuid, &r.payload, &r.metadata}
	})
}

func (p postgres) remove(ctx context.Context, db *sql.DB, topic string, have tableSet, r row) error {
	t := p.tables(topic)
	query := `DELETE FROM ` + t.Messages + ` WHERE transaction_id = $1::text::xid8 AND "offset" = $2`
	if have.leases {
		query = `WITH leases AS (DELETE FROM ` + t.Leases + ` WHERE "offset" = $2 AND transaction_id = $1::text::xid8) ` + query
	}
	_, err := db.ExecContext(ctx, query, strconv.FormatInt(r.txID, 10), r.offset)
	return err
}

func (p postgres) existing(ctx context.Context, db *sql.DB, topic string) (have tableSet, err error) {
	t := p.tables(topic)
	err = db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL`,
		t.Messages, t.Offsets, t.Leases).Scan(&have.messages, &have.offsets, &have.leases)
	return have, err
}

func (p postgres) hasGroup(ctx context.Context, db *sql.DB, topic, group string) (known bool, err error) {
	err = db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+p.tables(topic).Offsets+` WHERE consumer_group = $1)`, group).Scan(&known)
	return known, err
}

func (p postgres) trim(ctx context.Context, db *sql.DB, topic string, have tableSet, limit int) (int64, error) {
	t := p.tables(topic)
	leased := ``
	if have.leases {
		leased = `
			AND NOT EXISTS (SELECT 1 FROM ` + t.Leases + ` l WHERE l.transaction_id = m.transaction_id AND l."offset" = m."offset")`
	}
	// The lowest cursor of the groups, in the order they read: every message at or below it
	// is of a transaction that had ended, and every group has claimed it. A claim moves a
	// cursor and leases what it passes in one statement, so a message below the cursor that
	// this statement reads is either leased here or settled.
	return dbqueue.Affected(db.ExecContext(ctx, `WITH low AS (
			SELECT last_processed_transaction_id AS tx, COALESCE(offset_acked, 0) AS off FROM `+t.Offsets+`
			ORDER BY 1, 2 LIMIT 1
		), batch AS (
			SELECT m.transaction_id, m."offset" FROM `+t.Messages+` m, low
			WHERE (m.transaction_id, m."offset") <= (low.tx, low.off)`+leased+`
			ORDER BY m.transaction_id, m."offset" LIMIT $1
		)
		DELETE FROM `+t.Messages+` m USING batch b WHERE m.transaction_id = b.transaction_id AND m."offset" = b."offset"`, limit))
}
