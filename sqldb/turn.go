package sqldb

import (
	"context"
	"database/sql/driver"
	"path/filepath"
	"sync"
	"time"
)

// An SQLite file has one writer at a time, and a transaction that begins IMMEDIATE (sqldb's
// default for SQLite) holds the write lock from BEGIN to COMMIT. A BEGIN that finds the lock
// taken sleeps in SQLite's busy handler and looks again on a fixed schedule (1, 2, 5, 10, 15,
// 20, 25, 25, 25, 50, 50, then 100 ms), however soon the lock is free: with a handler's
// transactions or several groups of a group commit in flight at once, a few of them sleep 50
// to 100 ms, the size of the embedded setup's steady-state p99 latency (about 111 ms). Four
// writers of one file, each committing an insert every 5 ms, measured a transaction p99 of
// 99 to 133 ms so, and 10 to 40 ms when they took turns. The pools of this process over one
// such file therefore hand their transactions the write lock in arrival order, before BEGIN;
// SQLite's lock still rules between processes, and statements outside a transaction take no
// turn. A turn is kept per file path for the life of the process (a channel each).

var writeTurns struct {
	mu    sync.Mutex
	files map[string]chan struct{}
}

// writeTurn returns the turn of the file at path, shared by every pool of this process over it:
// a channel that holds a token while a transaction has the turn.
func writeTurn(path string) chan struct{} {
	if abs, err := filepath.Abs(path); err == nil {
		path = abs
	}
	writeTurns.mu.Lock()
	defer writeTurns.mu.Unlock()
	if writeTurns.files == nil {
		writeTurns.files = map[string]chan struct{}{}
	}
	turn, ok := writeTurns.files[path]
	if !ok {
		turn = make(chan struct{}, 1)
		writeTurns.files[path] = turn
	}
	return turn
}

// turnConnector makes connections whose transactions take the file's turn.
type turnConnector struct {
	driver.Connector
	turn chan struct{}
	wait time.Duration // the longest wait for a turn: the busy timeout
}

func (c turnConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &turnConn{Conn: conn, turn: c.turn, wait: c.wait}, nil
}

// Close closes the wrapped connector if it has anything to close.
func (c turnConnector) Close() error { return closeConnector(c.Connector) }

// turnConn is a connection whose transactions hold the file's turn from before BEGIN until
// COMMIT or ROLLBACK, and which runs the statements it ran before compiled (stmtCache). It
// passes everything else to the driver's connection, which must implement the context
// interfaces of database/sql/driver (modernc.org/sqlite's does).
type turnConn struct {
	driver.Conn
	turn  chan struct{}
	wait  time.Duration
	held  bool // a transaction of this connection has the turn
	stmts stmtCache
}

var (
	_ driver.ConnBeginTx        = (*turnConn)(nil)
	_ driver.ConnPrepareContext = (*turnConn)(nil)
	_ driver.ExecerContext      = (*turnConn)(nil)
	_ driver.QueryerContext     = (*turnConn)(nil)
	_ driver.Pinger             = (*turnConn)(nil)
	_ driver.SessionResetter    = (*turnConn)(nil)
	_ driver.Validator          = (*turnConn)(nil)
	_ driver.NamedValueChecker  = (*turnConn)(nil)
)

// Begin is BeginTx with the default options.
func (c *turnConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

// BeginTx waits for the file's turn, in arrival order, until ctx ends or the busy timeout has
// passed, then begins the transaction: after the busy timeout without its turn, SQLite's
// busy handler decides, as it would without turns (a second transaction of a file with a
// short busy timeout fails with SQLITE_BUSY). A transaction that DB.BeginTxx begins has
// waited already.
func (c *turnConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if c.held {
		// A transaction of this connection has not ended: database/sql has yet to roll back
		// one whose context ended, and discards the connection when it has. Waiting for the
		// turn, which that transaction holds, would wait for good.
		return nil, driver.ErrBadConn
	}
	if g, ok := grantOf(ctx); ok {
		c.held = g.held // DB.BeginTxx waited for the turn (writer.go)
	} else {
		held, err := takeTurn(ctx, c.turn, c.wait)
		if err != nil {
			return nil, err
		}
		c.held = held
	}
	var (
		tx  driver.Tx
		err error
	)
	if b, ok := c.Conn.(driver.ConnBeginTx); ok {
		tx, err = b.BeginTx(ctx, opts)
	} else {
		tx, err = c.Conn.Begin() //nolint:staticcheck // the driver has no BeginTx
	}
	if err != nil {
		c.release()
		return nil, err
	}
	return turnTx{Tx: tx, c: c}, nil
}

// release gives the turn to the transaction that has waited longest.
func (c *turnConn) release() {
	if c.held {
		c.held = false
		<-c.turn
	}
}

// Close closes the connection, and gives the turn back if a transaction of it still had it.
func (c *turnConn) Close() error {
	c.stmts.close()
	err := c.Conn.Close()
	c.release()
	return err
}

func (c *turnConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if p, ok := c.Conn.(driver.ConnPrepareContext); ok {
		return p.PrepareContext(ctx, query)
	}
	return c.Conn.Prepare(query)
}

func (c *turnConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if res, ok, err := c.stmts.exec(ctx, c.Conn, query, args); ok {
		return res, err
	}
	if e, ok := c.Conn.(driver.ExecerContext); ok {
		return e.ExecContext(ctx, query, args)
	}
	return nil, driver.ErrSkip
}

func (c *turnConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if rows, ok, err := c.stmts.query(ctx, c.Conn, query, args); ok {
		return rows, err
	}
	if q, ok := c.Conn.(driver.QueryerContext); ok {
		return q.QueryContext(ctx, query, args)
	}
	return nil, driver.ErrSkip
}

func (c *turnConn) Ping(ctx context.Context) error {
	if p, ok := c.Conn.(driver.Pinger); ok {
		return p.Ping(ctx)
	}
	return nil
}

func (c *turnConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c *turnConn) IsValid() bool {
	if v, ok := c.Conn.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}

// CheckNamedValue passes the driver's own check on, or converts as database/sql does for a
// driver without one.
func (c *turnConn) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := c.Conn.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

// turnTx is a transaction that holds its connection's turn until it ends.
type turnTx struct {
	driver.Tx
	c *turnConn
}

func (t turnTx) Commit() error {
	defer t.c.release()
	return t.Tx.Commit()
}

func (t turnTx) Rollback() error {
	defer t.c.release()
	return t.Tx.Rollback()
}
