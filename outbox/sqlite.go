package outbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/queuetable"
	"github.com/onceflow/onceflow/internal/sqllock"
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
	table, messagesTable, offsetsTable string
}

func newSQLite(table string) *sqlite {
	return &sqlite{table: table, messagesTable: sqlitequeue.MessagesTable(table),
		offsetsTable: sqlitequeue.OffsetsTable(table)}
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
	t, o := sqldb.SQLite.Quote(s.messagesTable), sqldb.SQLite.Quote(s.offsetsTable)
	return `SELECT COUNT(*),
	COALESCE(CAST(ROUND(unixepoch(MIN(created_at), 'subsec') * 1000000) AS INTEGER), 0),
	COALESCE(CAST(ROUND((unixepoch('now', 'subsec') - unixepoch(MIN(created_at), 'subsec')) * 1000000) AS INTEGER), 0)
FROM ` + t + `
WHERE "offset" > COALESCE((SELECT offset_acked FROM ` + o + ` WHERE consumer_group = ?1), 0)
	OR ` + queuetable.Leased(s.table, `"offset"`, `?1`), []any{group}
}

func (s *sqlite) purgeQuery() string {
	t, o := sqldb.SQLite.Quote(s.messagesTable), sqldb.SQLite.Quote(s.offsetsTable)
	return `DELETE FROM ` + t + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + t + `
	WHERE "offset" < (SELECT MIN(COALESCE(offset_acked, 0)) FROM ` + o + `)
	AND NOT ` + queuetable.Leased(s.table, `"offset"`, ``) + `
	ORDER BY "offset" LIMIT ?)`
}

// publishLock is not needed: the transaction holds the write lock already.
func (s *sqlite) publishLock() string { return "" }

// notify is empty: SQLite tells no other connection of a commit. The Outbox wakes the relays
// of its own process instead (see Relay).
func (s *sqlite) notify() string { return "" }

// purgeLock takes an exclusive lock on the file "<database file>.<messages table>.purge.lock",
// created beside the database and left in place, without waiting; a database without a file
// is locked in this process only.
func (s *sqlite) purgeLock(_ context.Context, db *sqldb.DB) (func(), bool, error) {
	if db.Path == "" {
		mu, _ := memoryPurgeLocks.LoadOrStore(db.DB.DB, &sync.Mutex{})
		if !mu.(*sync.Mutex).TryLock() {
			return nil, false, nil
		}
		return mu.(*sync.Mutex).Unlock, true, nil
	}
	path := fmt.Sprintf("%s.%s.purge.lock", db.Path, s.messagesTable)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, false, fmt.Errorf("open the purge lock file: %w", err)
	}
	held, err := sqllock.TryLockFile(f)
	if err != nil || !held {
		return nil, false, errors.Join(err, f.Close())
	}
	return func() {
		_ = sqllock.UnlockFile(f)
		_ = f.Close()
	}, true, nil
}

// memoryPurgeLocks stands in for the lock file of databases without a file.
var memoryPurgeLocks sync.Map // map[*sql.DB]*sync.Mutex
