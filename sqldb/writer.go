package sqldb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jmoiron/sqlx"
)

// SQLite drops a connection's page cache when the connection begins a transaction after
// another connection changed the file. The transactions of a pool take turns (turn.go), and
// on several connections each one began cold: it read again, from the log or the file, every
// page it touched, the index pages of the dedup table and of the business tables above all: in
// a CPU profile of a group-commit drain of the embedded setup (c=16, 85,000 messages), 0.40 s
// of 4.6 s, and 0.09 s on one connection. The transactions that
// DB.BeginTx and DB.BeginTxx begin on a pool over an SQLite file therefore all run on one
// connection, the writer, whose pages stay cached from one to the next: they take the file's
// turn before they take the connection.

// minPoolToHold is the smallest limit of open connections (sql.DB.SetMaxOpenConns) of a pool
// from which the writer is held between transactions. In a smaller pool, such as one of a
// single connection, holding it would leave the statements outside transactions none: there
// each transaction takes a connection of the pool, as it would without the writer.
const minPoolToHold = 4

// writer is the connection of a pool's transactions over an SQLite file with turns.
type writer struct {
	turn chan struct{}
	wait time.Duration // the longest wait for a turn: the busy timeout

	mu     sync.Mutex
	conn   *sqlx.Conn // nil before the first transaction, after a broken one, and after close
	closed bool
}

// grant tells the connection that a transaction begins on that the caller has waited for the
// file's turn already: held when it has the turn, not held when it waited the busy timeout
// out without it. The first BeginTx that finds it in its context uses it; a transaction begun
// with a context derived from that one waits for its turn as usual.
type grant struct {
	used atomic.Bool
	held bool
}

type grantKey struct{}

// grantOf returns the grant in ctx that no BeginTx has used yet.
func grantOf(ctx context.Context) (*grant, bool) {
	g, ok := ctx.Value(grantKey{}).(*grant)
	if !ok || !g.used.CompareAndSwap(false, true) {
		return nil, false
	}
	return g, true
}

// begin waits for the file's turn and begins a transaction on the writer, or on a connection
// of pool when the pool is too small to hold one or the busy timeout passed without the turn
// (SQLite's busy handler then decides, as it does without turns).
func (w *writer) begin(ctx context.Context, pool *sqlx.DB, opts *sql.TxOptions) (*sqlx.Tx, error) {
	if limit := pool.Stats().MaxOpenConnections; limit > 0 && limit < minPoolToHold {
		if conn := w.release(); conn != nil {
			go conn.Close() // after its transaction, which may be the caller's
		}
		return pool.BeginTxx(ctx, opts)
	}
	held, err := takeTurn(ctx, w.turn, w.wait)
	if err != nil {
		return nil, err
	}
	if !held {
		return pool.BeginTxx(context.WithValue(ctx, grantKey{}, &grant{}), opts)
	}
	g := &grant{held: true}
	gctx := context.WithValue(ctx, grantKey{}, g)
	conn, err := w.take(ctx, pool)
	var tx *sqlx.Tx
	switch {
	case err == nil && conn == nil: // closed: the pool says what it says
		tx, err = pool.BeginTxx(gctx, opts)
	case err == nil:
		tx, err = conn.BeginTxx(gctx, opts)
	}
	if err == nil {
		return tx, nil
	}
	// The connection's BeginTx gives the turn back when it fails; before it, the turn is still
	// this call's.
	if g.used.CompareAndSwap(false, true) {
		<-w.turn
	}
	if conn != nil && (errors.Is(err, sql.ErrConnDone) || errors.Is(err, driver.ErrBadConn)) {
		// The writer broke: the next transaction takes another, and this one a connection of
		// the pool, which database/sql replaces if it is broken too.
		w.drop(conn)
		return pool.BeginTxx(ctx, opts)
	}
	return nil, err
}

// take returns the writer, taking a connection from pool when there is none, or nil once the
// writer is closed.
func (w *writer) take(ctx context.Context, pool *sqlx.DB) (*sqlx.Conn, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, nil
	}
	if w.conn == nil {
		conn, err := pool.Connx(ctx)
		if err != nil {
			return nil, err
		}
		w.conn = conn
	}
	return w.conn, nil
}

// drop closes conn, if it is still the writer, so that the next transaction takes another.
func (w *writer) drop(conn *sqlx.Conn) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.conn == conn {
		w.conn = nil
	}
	_ = conn.Close()
}

// release returns the writer, if there is one, and forgets it: the next transaction takes
// another. Closing the returned connection gives it back to its pool, after its transaction
// if one is open.
func (w *writer) release() *sqlx.Conn {
	w.mu.Lock()
	defer w.mu.Unlock()
	conn := w.conn
	w.conn = nil
	return conn
}

// close gives the writer back for good: the transactions begun after it take connections of
// the pool.
func (w *writer) close() {
	w.mu.Lock()
	w.closed = true
	conn := w.conn
	w.conn = nil
	w.mu.Unlock()
	if conn != nil {
		_ = conn.Close()
	}
}

// takeTurn waits for the turn, in arrival order, until ctx ends or wait has passed, and
// reports whether it has it.
func takeTurn(ctx context.Context, turn chan struct{}, wait time.Duration) (bool, error) {
	select {
	case turn <- struct{}{}:
		return true, nil
	default:
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case turn <- struct{}{}:
		return true, nil
	case <-ctx.Done():
		return false, ctx.Err()
	case <-t.C:
		return false, nil
	}
}

// BeginTxx begins a transaction. On a pool that Open made over an SQLite file, it waits for
// the file's turn first, and the transaction runs on the one connection that the pool's
// transactions share, whose cached pages the transaction before it left warm: SQLite drops a
// connection's cache when it begins a transaction after another connection wrote the file.
// A pool limited to fewer than 4 open connections (SetMaxOpenConns) shares none, and a
// transaction begun on the embedded *sql.DB takes its turn on any connection.
func (db *DB) BeginTxx(ctx context.Context, opts *sql.TxOptions) (*sqlx.Tx, error) {
	if db.w == nil {
		return db.DB.BeginTxx(ctx, opts)
	}
	return db.w.begin(ctx, db.DB, opts)
}

// BeginTx is BeginTxx for a database/sql transaction.
func (db *DB) BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error) {
	tx, err := db.BeginTxx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return tx.Tx, nil
}

// Beginx is BeginTxx with the background context and the default options.
func (db *DB) Beginx() (*sqlx.Tx, error) { return db.BeginTxx(context.Background(), nil) }

// Begin is BeginTx with the background context and the default options.
func (db *DB) Begin() (*sql.Tx, error) { return db.BeginTx(context.Background(), nil) }

// Close gives the writing connection of an SQLite pool back, after its open transaction, and
// closes the pool.
func (db *DB) Close() error {
	if db.w != nil {
		db.w.close()
	}
	return db.DB.Close()
}
