package outbox

import (
	"context"
	"database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/internal/queuetable"
	"github.com/onceflow/onceflow/sqldb"
)

// sqlite is the SQLite dialect: the embedded queue's adapters (queuetable.SchemaAdapter and
// OffsetsAdapter), so the tables are named as the queue names a topic's tables:
// onceflow_queue_<table> and onceflow_offsets_<table>.
//
// SQLite has one writer at a time, so offsets become visible in increasing order and no
// message can be overtaken. The relay reads with sqliteSubscriber, which holds no write lock
// while it publishes; relays of one group take turns through a lock file beside the database.
type sqlite struct {
	table, messagesTable, offsetsTable string
}

func newSQLite(table string) *sqlite {
	return &sqlite{table: table, messagesTable: queuetable.MessagesTable(table), offsetsTable: queuetable.OffsetsTable(table)}
}

func (s *sqlite) tables() (string, string) { return s.messagesTable, s.offsetsTable }

func (s *sqlite) schema(batchSize int) wsql.SchemaAdapter {
	return queuetable.SchemaAdapter{BatchSize: batchSize}
}

func (s *sqlite) offsets() wsql.OffsetsAdapter {
	return sqliteOffsets{table: sqldb.SQLite.Quote(s.offsetsTable)}
}

// sqliteOffsets is queuetable.OffsetsAdapter with the group registered before subscribing,
// so that Stats and Purge know it from its first run on.
type sqliteOffsets struct {
	queuetable.OffsetsAdapter
	table string // quoted
}

func (a sqliteOffsets) BeforeSubscribingQueries(_, consumerGroup string) []wsql.Query {
	return []wsql.Query{{
		Query: `INSERT INTO ` + a.table + ` (consumer_group, offset_acked) VALUES (?, 0) ON CONFLICT (consumer_group) DO NOTHING`,
		Args:  []any{consumerGroup},
	}}
}

func (s *sqlite) migrate(ctx context.Context, db *sqldb.DB) error {
	return runInTx(ctx, db.DB.DB, func(tx *sql.Tx) error {
		return execAll(ctx, tx, append(queuetable.SchemaAdapter{}.SchemaInitializingQueries(s.table),
			queuetable.OffsetsAdapter{}.SchemaInitializingQueries(s.table)...)...)
	})
}

func (s *sqlite) statsQuery() string {
	t, o := sqldb.SQLite.Quote(s.messagesTable), sqldb.SQLite.Quote(s.offsetsTable)
	return `SELECT COUNT(*),
	COALESCE(CAST(ROUND(unixepoch(MIN(created_at), 'subsec') * 1000000) AS INTEGER), 0),
	COALESCE(CAST(ROUND((unixepoch('now', 'subsec') - unixepoch(MIN(created_at), 'subsec')) * 1000000) AS INTEGER), 0)
FROM ` + t + `
WHERE "offset" > COALESCE((SELECT offset_acked FROM ` + o + ` WHERE consumer_group = ?), 0)`
}

func (s *sqlite) purgeQuery() string {
	t, o := sqldb.SQLite.Quote(s.messagesTable), sqldb.SQLite.Quote(s.offsetsTable)
	return `DELETE FROM ` + t + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + `
	WHERE "offset" < (SELECT MIN(COALESCE(offset_acked, 0)) FROM ` + o + `)
	ORDER BY "offset" LIMIT ?)`
}

// publishLock is not needed: the transaction holds the write lock already.
func (s *sqlite) publishLock() string { return "" }
