package outbox

import (
	"context"
	"database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/sqldb"
)

// postgres is the PostgreSQL dialect: watermill-sql's DefaultPostgreSQLSchema and
// DefaultPostgreSQLOffsetsAdapter on the tables <table> and <table>_offsets.
//
// Every row records the id of the transaction that wrote it (pg_current_xact_id()), and the
// relay reads only rows of transactions older than the oldest one still running
// (pg_snapshot_xmin), in (transaction id, offset) order. A transaction that commits late is
// therefore never overtaken by a later one: the relay waits for it. The price is that any
// long-running writing transaction on the server holds every relay back until it ends.
// Requires PostgreSQL 13 or later (xid8).
type postgres struct {
	table, offsetsTable string
}

func newPostgres(table string) *postgres {
	return &postgres{table: table, offsetsTable: table + offsetsSuffix}
}

// pgLockKey is an advisory lock key for the migration of table ($1) in the current schema:
// the first 64 bits of an MD5, so that outboxes of the same name in two schemas of one
// database do not exclude each other.
const pgLockKey = `('x' || substr(md5('onceflow.outbox.migrate:' || coalesce(current_schema(), '') || '.' || $1::text), 1, 16))::bit(64)::bigint`

func (p *postgres) tables() (string, string) { return p.table, p.offsetsTable }

func (p *postgres) schema(batchSize int) wsql.SchemaAdapter {
	return wsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(string) string { return sqldb.Postgres.Quote(p.table) },
		SubscribeBatchSize:        batchSize,
	}
}

func (p *postgres) offsets() wsql.OffsetsAdapter {
	// Its BeforeSubscribingQueries already inserts the group's zero offsets.
	return wsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(string) string { return sqldb.Postgres.Quote(p.offsetsTable) },
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
	return runInTx(ctx, db.DB.DB, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgLockKey+`)`, p.table); err != nil {
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
}

// statsQuery counts the rows after the group's position (transaction id, offset); a group
// without an offsets row has relayed nothing.
func (p *postgres) statsQuery() string {
	t, o := sqldb.Postgres.Quote(p.table), sqldb.Postgres.Quote(p.offsetsTable)
	return `SELECT COUNT(*),
	COALESCE(ROUND(EXTRACT(EPOCH FROM MIN(m.created_at)) * 1000000), 0)::BIGINT,
	COALESCE(ROUND(EXTRACT(EPOCH FROM clock_timestamp() - MIN(m.created_at)) * 1000000), 0)::BIGINT
FROM ` + t + ` AS m
LEFT JOIN ` + o + ` AS g ON g.consumer_group = $1
WHERE g.consumer_group IS NULL
	OR m.transaction_id > g.last_processed_transaction_id
	OR (m.transaction_id = g.last_processed_transaction_id AND m."offset" > COALESCE(g.offset_acked, 0))`
}

// purgeQuery deletes rows strictly before the position of every registered group. A group
// acknowledges a row only once every transaction with a smaller id has ended, so no row before
// its position can still appear.
func (p *postgres) purgeQuery() string {
	t, o := sqldb.Postgres.Quote(p.table), sqldb.Postgres.Quote(p.offsetsTable)
	return `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(
	SELECT m.ctid FROM ` + t + ` AS m
	WHERE EXISTS (SELECT 1 FROM ` + o + `)
	AND NOT EXISTS (
		SELECT 1 FROM ` + o + ` AS g
		WHERE (m.transaction_id, m."offset") >= (g.last_processed_transaction_id, COALESCE(g.offset_acked, 0))
	)
	LIMIT $1))`
}

func (p *postgres) publishLock() string { return "" }
