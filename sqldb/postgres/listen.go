package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceflow/onceflow/sqldb"
)

// listen is the Driver.Listen of PostgreSQL: LISTEN on conn, then pgx's WaitForNotification.
// The connection is marked bad when it fails, so that database/sql does not reuse it.
func listen(ctx context.Context, conn *sql.Conn, channel string, ready, notified func()) error {
	return conn.Raw(func(dc any) error {
		sc, ok := dc.(interface{ Conn() *pgx.Conn })
		if !ok {
			return fmt.Errorf("%w: the connection is a %T, not pgx's", sqldb.ErrCannotListen, dc)
		}
		pc := sc.Conn()
		if _, err := pc.Exec(ctx, `LISTEN `+sqldb.Postgres.Quote(channel)); err != nil {
			return errors.Join(fmt.Errorf("listen on %s: %w", channel, err), driver.ErrBadConn)
		}
		ready()
		for {
			if _, err := pc.WaitForNotification(ctx); err != nil {
				return errors.Join(fmt.Errorf("wait for notifications on %s: %w", channel, err), driver.ErrBadConn)
			}
			notified()
		}
	})
}
