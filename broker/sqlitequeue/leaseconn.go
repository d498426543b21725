package sqlitequeue

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
)

// The subscriptions' transactions (claims of messages, settlements of their leases) are most of
// the queue file's commits: with synchronous=FULL each one waits for the disk (an fsync of the
// WAL), which kept a draining consumer waiting rather than working. They run on a connection of
// their own, with synchronous=NORMAL. In WAL mode such a commit is written to the WAL before it
// returns, so it survives the death of the process (SIGKILL included) exactly as a FULL one
// does; only a power loss or a crash of the operating system may take back the last of them.
// The WAL is synced in order, so that never takes back a publish, which still commits with FULL,
// nor anything committed before a publish. What it can take back is a claim or a settlement, and
// both only make messages come again: an unrecorded claim is claimed again, an unrecorded
// acknowledgement leaves its message to be delivered again, as when a consumer dies before its
// acknowledgement is committed. Delivery stays at-least-once, and onceflow's deduplication keeps
// the processing exactly-once. A queue file whose URL asks for another synchronous than FULL
// keeps it for these transactions too.

// leaseConn is the connection of a Queue's claims and settlements. It is used in the file's
// turn to write only, so by one transaction at a time; the mutex only guards it against Close.
type leaseConn struct {
	mu     sync.Mutex
	conn   *sql.Conn // nil before the first transaction and after a broken one
	closed bool
}

// run runs fn in a transaction on the lease connection, taking a connection from db first when
// it has none. A connection that breaks is dropped, and the next transaction takes another.
func (c *leaseConn) run(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	if c.conn == nil {
		conn, err := openLeaseConn(ctx, db)
		if err != nil {
			return err
		}
		c.conn = conn
	}
	err := runInTx(ctx, c.conn, fn)
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) {
		discard(c.conn)
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
// synchronous from FULL to NORMAL.
func openLeaseConn(ctx context.Context, db *sql.DB) (*sql.Conn, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("take a connection for claims and settlements: %w", err)
	}
	var level int
	err = conn.QueryRowContext(ctx, `PRAGMA synchronous`).Scan(&level)
	if err == nil && level == synchronousFull {
		_, err = conn.ExecContext(ctx, `PRAGMA synchronous = NORMAL`)
	}
	if err != nil {
		discard(conn)
		return nil, fmt.Errorf("set synchronous=NORMAL on the connection of claims and settlements: %w", err)
	}
	return conn, nil
}

// discard closes conn for good instead of giving it back to the pool, where it would commit
// publishes with its lowered synchronous.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}
