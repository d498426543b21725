package sqlitequeue

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

// leaseConn is the connection of a Queue's claims and settlements, most of the file's commits,
// which with synchronous=FULL would each wait for an fsync of the WAL: it runs them with
// synchronous=NORMAL (the package documentation says what that risks), or with the URL's
// synchronous when it is not FULL. Its mutex keeps it to one transaction at a time, and guards
// it against Close.
type leaseConn struct {
	mu      sync.Mutex
	conn    *sql.Conn // nil before the first transaction and after a broken one
	lowered bool      // conn's synchronous was lowered from FULL
	closed  bool
}

// minPoolToHold is the smallest limit of open connections (sql.DB.SetMaxOpenConns) of a pool
// from which the lease connection is held between transactions. In a smaller pool, such as one
// of a single connection, holding it would leave publishers and readers none: there it is taken
// for each transaction and given back with synchronous=FULL again.
const minPoolToHold = 4

// run runs fn in a transaction on the lease connection, taking a connection from db first when
// it has none. A connection that breaks is dropped, and the next transaction takes another.
func (c *leaseConn) run(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if c.conn == nil {
		conn, lowered, err := openLeaseConn(ctx, db)
		if err != nil {
			return err
		}
		c.conn, c.lowered = conn, lowered
	}
	err := dbqueue.InTx(ctx, c.conn, nil, fn)
	// A transaction whose context ended may still be rolled back by database/sql, in a
	// goroutine of its own, which then closes the connection: the next transaction must not
	// begin on it meanwhile (its BEGIN would wait for the file's turn, which that transaction
	// holds, while holding the connection that the rollback needs).
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) || (err != nil && ctx.Err() != nil) {
		discard(c.conn)
		c.conn = nil
		return err
	}
	if limit := db.Stats().MaxOpenConnections; limit > 0 && limit < minPoolToHold {
		giveBack(c.conn, c.lowered)
		c.conn = nil
	}
	return err
}

// close drops the connection; run fails with ErrClosed from then on.
func (c *leaseConn) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.conn != nil {
		discard(c.conn)
		c.conn = nil
	}
}

// synchronousFull is the value of PRAGMA synchronous for FULL.
const synchronousFull = 2

// openLeaseConn takes a connection from db for claims and settlements and lowers its
// synchronous from FULL to NORMAL, and reports whether it did.
func openLeaseConn(ctx context.Context, db *sql.DB) (*sql.Conn, bool, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("take a connection for claims and settlements: %w", err)
	}
	var level int
	err = conn.QueryRowContext(ctx, `PRAGMA synchronous`).Scan(&level)
	lower := err == nil && level == synchronousFull
	if lower {
		_, err = conn.ExecContext(ctx, `PRAGMA synchronous = NORMAL`)
	}
	if err != nil {
		discard(conn)
		return nil, false, fmt.Errorf("set synchronous=NORMAL on the connection of claims and settlements: %w", err)
	}
	return conn, lower, nil
}

// giveBack returns conn to its pool, with synchronous=FULL again if it was lowered, or
// discards it when that fails.
func giveBack(conn *sql.Conn, lowered bool) {
	if lowered {
		if _, err := conn.ExecContext(context.Background(), `PRAGMA synchronous = FULL`); err != nil {
			discard(conn)
			return
		}
	}
	_ = conn.Close()
}

// discard closes conn for good instead of giving it back to the pool, where it would commit
// publishes with its lowered synchronous.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}
