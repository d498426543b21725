package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// ErrCannotListen reports a database whose driver cannot wait for notifications: only
// PostgreSQL's can (LISTEN). Callers fall back to polling.
var ErrCannotListen = errors.New("sqldb: the database cannot listen for notifications")

// Listen makes conn, a connection of db that the caller took from its pool, listen on the
// notification channel and calls ready once it does, then notified for each notification,
// until ctx ends or the connection fails. It needs a driver that registered
// Driver.Listen (PostgreSQL's); any other fails at once with ErrCannotListen. The connection
// listens until it is closed: close it, do not return it to the pool for other work, once
// Listen returns.
func Listen(ctx context.Context, db *DB, conn *sql.Conn, channel string, ready, notified func()) error {
	for _, d := range drivers() {
		if d.Dialect == db.Dialect {
			if d.Listen == nil {
				break
			}
			return d.Listen(ctx, conn, channel, ready, notified)
		}
	}
	return fmt.Errorf("%w: %s", ErrCannotListen, db.Dialect)
}
