package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/sqldb"
)

// postgres is the PostgreSQL dialect: tables laid out as watermill-sql's
// DefaultPostgreSQLSchema and offsets adapter, <table> and <table>_offsets, and the relays'
// leases in <table>_leases (broker/sqlqueue's layout, with its index <table>_due).
//
// Every row records the id of the transaction that wrote it (pg_current_xact_id()), and the
// relays claim only rows of transactions older than the oldest one still running
// (pg_snapshot_xmin), in (transaction id, offset) order. A transaction that commits late is
// therefore never passed by the group's cursor: the relays wait for it. The price is that any
// long-running writing transaction on the server holds every relay back until it ends.
// Requires PostgreSQL 13 or later (xid8).
//
// The relays LISTEN on the outbox's channel; Publish notifies it (see wake.go).
type postgres struct {
	table, offsetsTable string
}

func newPostgres(table string) *postgres {
	return &postgres{table: table, offsetsTable: table + offsetsSuffix}
}

// pgKey is an advisory lock key for purpose on the outbox ($1) in the current schema: the
// first 64 bits of an MD5, so that outboxes of the same name in two schemas of one database do
// not exclude each other.
func pgKey(purpose string) string {
	return `('x' || substr(md5('onceflow.outbox.` + purpose + `:' || coalesce(current_schema(), '') || '.' || $1::text), 1, 16))::bit(64)::bigint`
}

// pgChannel is the notification channel of the outbox ($1) in the current schema: a name of at
// most 32 bytes of [a-z0-9_], whatever the schema's and the table's names.
const pgChannel = `'onceflow_outbox_' || substr(md5(coalesce(current_schema(), '') || '.' || $1::text), 1, 16)`

func (p *postgres) tables() (string, string) { return p.table, p.offsetsTable }

// queueTables are the outbox's tables as broker/sqlqueue names a topic's.
func (p *postgres) queueTables() sqlqueue.Tables {
	return sqlqueue.Tables{Messages: p.table, Offsets: p.offsetsTable, Leases: p.table + leasesSuffix, DueIndex: p.table + "_due"}
}

func (p *postgres) insertSchema() wsql.SchemaAdapter {
	return wsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(string) string { return sqldb.Postgres.Quote(p.table) },
	}
}

func (p *postgres) migrate(ctx context.Context, db *sqldb.DB) error {
	t, o := sqldb.Postgres.Quote(p.table), sqldb.Postgres.Quote(p.offsetsTable)
	// The columns are those of watermill-sql's DefaultPostgreSQLSchema, except created_at: a
	// TIMESTAMPTZ set when the row is inserted, so that the lag does not depend on the
	// sessions' time zones or on how long the transaction ran before it published.
	//
	// Concurrent CREATE TABLE IF NOT EXISTS can fail with a unique violation on pg_type: the
	// transaction-scoped advisory lock makes concurrent migrations take turns.
	err := sqltx.RunSQL(ctx, db.DB.DB, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgKey("migrate")+`)`, p.table); err != nil {
			return err
		}
		return execAll(ctx, tx, wsql.Query{Query: `CREATE TABLE IF NOT EXISTS ` + t + ` (
	"offset"         BIGSERIAL,
	"uuid"           VARCHAR(36) NOT NULL,
	"created_at"     TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
	"payload"        JSON DEFAULT NULL,
	"metadata"       JSON DEFAULT NULL,
	"transaction_id" xid8 NOT NULL,
	PRIMARY KEY ("transaction_id", "offset")
)`}, wsql.Query{Query: `CREATE TABLE IF NOT EXISTS ` + o + ` (
	consumer_group                VARCHAR(255) NOT NULL,
	offset_acked                  BIGINT,
	last_processed_transaction_id xid8 NOT NULL,
	PRIMARY KEY (consumer_group)
)`})
	})
	if err != nil {
		return err
	}
	// The leases table, as broker/sqlqueue lays it out, created on a connection of the pool
	// while the same advisory lock, held by a transaction that writes nothing, keeps concurrent
	// migrations out (two concurrent CREATE TABLE IF NOT EXISTS fail on the table's type).
	return sqltx.RunSQL(ctx, db.DB.DB, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgKey("migrate")+`)`, p.table); err != nil {
			return err
		}
		return createQueueTables(ctx, db, p.queueTables())
	})
}

// createQueueTables creates the tables that broker/sqlqueue adds to the outbox's: the leases.
func createQueueTables(ctx context.Context, db *sqldb.DB, tables sqlqueue.Tables) error {
	q, err := sqlqueue.New(db.DB.DB, db.Dialect, sqlqueue.Config{Tables: func(string) sqlqueue.Tables { return tables }})
	if err != nil {
		return err
	}
	return q.CreateTables(ctx, tables.Messages)
}

func (p *postgres) newSource(cfg RelayConfig) (source, error) {
	return newSQLSource(cfg, p.queueTables())
}

// stats counts the rows after the group's cursor (transaction id, offset) and the rows it has
// leased: handed out and not acknowledged, or waiting to be sent again. A group without an
// offsets row has relayed nothing.
func (p *postgres) stats(group string) (string, []any) {
	t, o, l := sqldb.Postgres.Quote(p.table), sqldb.Postgres.Quote(p.offsetsTable), sqldb.Postgres.Quote(p.table+leasesSuffix)
	return `WITH g AS (
	SELECT COALESCE(offset_acked, 0) AS off, last_processed_transaction_id AS tx FROM ` + o + ` WHERE consumer_group = $1
), w AS (
	SELECT m.created_at FROM ` + t + ` AS m
	WHERE NOT EXISTS (SELECT 1 FROM g) OR (m.transaction_id, m."offset") > ((SELECT tx FROM g), (SELECT off FROM g))
	UNION ALL
	SELECT m.created_at FROM ` + l + ` AS l JOIN ` + t + ` AS m ON m.transaction_id = l.transaction_id AND m."offset" = l."offset"
	WHERE l.consumer_group = $1
)
SELECT COUNT(*),
	COALESCE(ROUND(EXTRACT(EPOCH FROM MIN(created_at)) * 1000000), 0)::BIGINT,
	COALESCE(ROUND(EXTRACT(EPOCH FROM clock_timestamp() - MIN(created_at)) * 1000000), 0)::BIGINT
FROM w`, []any{group}
}

// purgeQuery deletes rows strictly before the cursor of every registered group that no group
// has leased. A cursor passes a row only once every transaction with a smaller id has ended,
// so no row before it can still appear; a leased row is not relayed yet.
func (p *postgres) purgeQuery() string {
	t, o, l := sqldb.Postgres.Quote(p.table), sqldb.Postgres.Quote(p.offsetsTable), sqldb.Postgres.Quote(p.table+leasesSuffix)
	return `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(
	SELECT m.ctid FROM ` + t + ` AS m
	WHERE EXISTS (SELECT 1 FROM ` + o + `)
	AND NOT EXISTS (
		SELECT 1 FROM ` + o + ` AS g
		WHERE (m.transaction_id, m."offset") >= (g.last_processed_transaction_id, COALESCE(g.offset_acked, 0))
	)
	AND NOT EXISTS (SELECT 1 FROM ` + l + ` AS l WHERE l.transaction_id = m.transaction_id AND l."offset" = m."offset")
	LIMIT $1))`
}

// purgeLock takes a session advisory lock on a connection of its own, which unlock releases
// and closes. A process that dies loses its session, and the lock with it.
func (p *postgres) purgeLock(ctx context.Context, db *sqldb.DB) (func(), bool, error) {
	conn, err := db.DB.DB.Conn(ctx)
	if err != nil {
		return nil, false, err
	}
	var held bool
	if err := conn.QueryRowContext(ctx, `SELECT pg_try_advisory_lock(`+pgKey("purge")+`)`, p.table).Scan(&held); err != nil || !held {
		return nil, false, errors.Join(err, conn.Close())
	}
	return func() {
		_, _ = conn.ExecContext(context.Background(), `SELECT pg_advisory_unlock(`+pgKey("purge")+`)`, p.table)
		_ = conn.Close()
	}, true, nil
}

func (p *postgres) publishLock() string { return "" }

func (p *postgres) notify() string { return `SELECT pg_notify(` + pgChannel + `, '')` }

// listen calls ready once it listens on the outbox's channel, on a connection of its own,
// then notified for each notification, until ctx ends or the connection fails. The connection
// is closed, not returned to the pool, when it returns.
func (p *postgres) listen(ctx context.Context, db *sqldb.DB, ready, notified func()) error {
	conn, err := db.DB.DB.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	var channel string
	if err := conn.QueryRowContext(ctx, `SELECT `+pgChannel, p.table).Scan(&channel); err != nil {
		return fmt.Errorf("name the notification channel: %w", err)
	}
	return sqldb.Listen(ctx, db, conn, channel, ready, notified)
}
