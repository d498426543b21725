package outbox

import (
	"context"
	"errors"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/sqldb"
)

// sqlite is the SQLite dialect: the outbox is a topic of the embedded queue (broker/sqlitequeue)
// in the application database, so its tables are named as the queue names a topic's:
// onceflow_queue_<table>, onceflow_offsets_<table> and onceflow_leases_<table>.
//
// SQLite has one writer at a time, so offsets become visible in increasing order and no row
// can be passed by a cursor before it commits. The relays claim and settle in short write
// transactions and hold none while they send.
type sqlite struct {
	table, messagesTable, offsetsTable, leasesTable string
}

func newSQLite(table string) *sqlite {
	return &sqlite{table: table, messagesTable: sqlitequeue.MessagesTable(table),
		offsetsTable: sqlitequeue.OffsetsTable(table), leasesTable: sqlitequeue.LeasesTable(table)}
}

func (s *sqlite) tables() (string, string) { return s.messagesTable, s.offsetsTable }

func (s *sqlite) insertSchema() wsql.SchemaAdapter { return sqlitequeue.SchemaAdapter{} }

func (s *sqlite) migrate(ctx context.Context, db *sqldb.DB) error {
	q, err := sqlitequeue.New(db, sqlitequeue.Config{})
	if err != nil {
		return err
	}
	return errors.Join(q.CreateTables(ctx, s.table), q.Close())
}

func (s *sqlite) newSource(cfg RelayConfig) (source, error) { return newSQLiteSource(cfg) }

// stats counts the rows after the group's cursor and the rows it has leased.
func (s *sqlite) stats(group string) (string, []any) {
	t, o, l := sqldb.SQLite.Quote(s.messagesTable), sqldb.SQLite.Quote(s.offsetsTable), sqldb.SQLite.Quote(s.leasesTable)
	return `SELECT COUNT(*),
	COALESCE(CAST(ROUND(unixepoch(MIN(created_at), 'subsec') * 1000000) AS INTEGER), 0),
	COALESCE(CAST(ROUND((unixepoch('now', 'subsec') - unixepoch(MIN(created_at), 'subsec')) * 1000000) AS INTEGER), 0)
FROM ` + t + `
WHERE "offset" > COALESCE((SELECT offset_acked FROM ` + o + ` WHERE consumer_group = ?1), 0)
	OR "offset" IN (SELECT "offset" FROM ` + l + ` WHERE consumer_group = ?1)`, []any{group}
}

func (s *sqlite) purgeQuery() string {
	t, o, l := sqldb.SQLite.Quote(s.messagesTable), sqldb.SQLite.Quote(s.offsetsTable), sqldb.SQLite.Quote(s.leasesTable)
	return `DELETE FROM ` + t + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + `
	WHERE "offset" < (SELECT MIN(COALESCE(offset_acked, 0)) FROM ` + o + `)
	AND "offset" NOT IN (SELECT "offset" FROM ` + l + `)
	ORDER BY "offset" LIMIT ?)`
}

// publishLock is not needed: the transaction holds the write lock already.
func (s *sqlite) publishLock() string { return "" }
