package outbox

import (
	"context"
	"database/sql"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/sqldb"
)

// dialect is what differs between the SQL dialects: the tables' names and DDL, the watermill-sql
// schema that Publish inserts with, the relay's queue over the tables, and the statements of
// Stats and Purge. Everything else in the package is shared.
type dialect interface {
	// tables returns the unquoted names of the messages and offsets tables.
	tables() (messages, offsets string)
	// insertSchema returns the watermill-sql schema adapter whose InsertQuery Publish runs.
	insertSchema() wsql.SchemaAdapter
	// migrate creates the tables if they are missing: messages, offsets, the relays' leases
	// (and on MySQL the publish lock).
	migrate(ctx context.Context, db *sqldb.DB) error
	// publishLock returns the statement that Publish runs in the transaction before it writes,
	// or "" when there is none. Its lock, held until the transaction ends, makes the
	// transactions that publish take turns.
	publishLock() string
	// notify returns the statement that notifies the relays listening on the outbox, with
	// the outbox's name as its argument, or "" when the dialect has none. Run in a transaction,
	// the database delivers it when the transaction commits.
	notify() string
	// newSource returns the lease-based subscription of the relay's consumer group over the
	// outbox's tables.
	newSource(cfg RelayConfig) (source, error)
	// stats returns the statement of Stats for group and its arguments. It returns COUNT(*),
	// the oldest created_at in Unix microseconds, and that row's age in microseconds by the
	// database clock (both 0 when there is no row).
	stats(group string) (query string, args []any)
	// purgeQuery returns the statement of one batch of Purge: its argument is the batch size;
	// it deletes at most that many rows and reports rows affected.
	purgeQuery() string
	// purgeLock takes, without waiting, the lock that lets one process at a time purge the
	// outbox. held is false when another holds it; unlock releases a lock that is held.
	purgeLock(ctx context.Context, db *sqldb.DB) (unlock func(), held bool, err error)
}

func newDialect(d sqldb.Dialect, table string) (dialect, error) {
	switch d {
	case sqldb.Postgres:
		return newPostgres(table), nil
	case sqldb.MySQL:
		return newMySQL(table), nil
	case sqldb.SQLite:
		return newSQLite(table), nil
	}
	return nil, fmt.Errorf("unsupported dialect %q (want postgres, mysql or sqlite)", d)
}

// execAll runs queries in tx, in order.
func execAll(ctx context.Context, tx *sql.Tx, queries ...wsql.Query) error {
	for _, q := range queries {
		if _, err := tx.ExecContext(ctx, q.Query, q.Args...); err != nil {
			return err
		}
	}
	return nil
}
