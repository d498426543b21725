package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// conn is a connection of pgx's database/sql driver whose transactions send BEGIN together
// with their first statement, in one round trip, where the driver makes BEGIN a round trip of
// its own. A transaction is begun on the server as it always is, before its first statement
// runs; one that runs no statement is never begun, and its Commit or Rollback costs nothing.
//
// Only a first statement run by ExecContext goes with BEGIN: a first query sends BEGIN alone
// before it, so that rows keep the driver's own conversions.
type conn struct {
	sc *stdlib.Conn
	// begin is the statement that begins the open transaction while it is not sent yet; empty
	// when the connection is in no transaction or its transaction has begun.
	begin string
	// aborted is set when the first statement failed before BEGIN ran (the server could not
	// prepare it): the transaction is failed, as it would be on the server had BEGIN run, until
	// it ends.
	aborted bool
}

// errAborted is what the server answers a statement in a failed transaction.
var errAborted = &pgconn.PgError{Severity: "ERROR", Code: "25P02",
	Message: "current transaction is aborted, commands ignored until end of transaction block"}

// wrapConn is the Driver.WrapConn of PostgreSQL.
func wrapConn(c driver.Conn) driver.Conn {
	if sc, ok := c.(*stdlib.Conn); ok {
		return &conn{sc: sc}
	}
	return c
}

// Conn returns the pgx connection, as the driver's connection does.
func (c *conn) Conn() *pgx.Conn { return c.sc.Conn() }

// Close closes the connection.
func (c *conn) Close() error { return c.sc.Close() }

// Ping checks the connection.
func (c *conn) Ping(ctx context.Context) error { return c.sc.Ping(ctx) }

// CheckNamedValue lets every argument through to pgx, as the driver does.
func (c *conn) CheckNamedValue(v *driver.NamedValue) error { return c.sc.CheckNamedValue(v) }

// ResetSession checks the connection before database/sql hands it out again, as the driver
// does.
func (c *conn) ResetSession(ctx context.Context) error { return c.sc.ResetSession(ctx) }

// BeginTx begins a transaction whose BEGIN goes out with its first statement.
func (c *conn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if c.sc.Conn().IsClosed() {
		return nil, driver.ErrBadConn
	}
	begin, ok := beginSQL(opts)
	if !ok {
		return c.sc.BeginTx(ctx, opts) // the driver says what it makes of the options
	}
	c.begin = begin
	return &tx{c: c, ctx: ctx}, nil
}

// beginSQL returns the statement that begins a transaction with opts, as pgx writes it, and
// false for an isolation level that pgx's driver does not know.
func beginSQL(opts driver.TxOptions) (string, bool) {
	var b strings.Builder
	b.WriteString("begin")
	switch sql.IsolationLevel(opts.Isolation) {
	case sql.LevelDefault:
	case sql.LevelReadUncommitted:
		b.WriteString(" isolation level read uncommitted")
	case sql.LevelReadCommitted:
		b.WriteString(" isolation level read committed")
	case sql.LevelRepeatableRead, sql.LevelSnapshot:
		b.WriteString(" isolation level repeatable read")
	case sql.LevelSerializable:
		b.WriteString(" isolation level serializable")
	default:
		return "", false
	}
	if opts.ReadOnly {
		b.WriteString(" read only")
	}
	return b.String(), true
}

// sendBegin sends the pending BEGIN alone, if there is one.
func (c *conn) sendBegin(ctx context.Context) error {
	if c.begin == "" {
		return nil
	}
	begin := c.begin
	c.begin = ""
	if _, err := c.sc.Conn().Exec(ctx, begin); err != nil {
		c.abortIfNotBegun()
		return badConn(err)
	}
	return nil
}

// abortIfNotBegun marks the transaction failed when a statement that was to begin it failed
// and the server is in no transaction.
func (c *conn) abortIfNotBegun() {
	pc := c.sc.Conn()
	c.aborted = !pc.IsClosed() && pc.PgConn().TxStatus() == 'I'
}

// ExecContext runs query, with the pending BEGIN before it in one round trip.
func (c *conn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if c.aborted {
		return nil, errAborted
	}
	if c.begin == "" {
		return c.sc.ExecContext(ctx, query, args)
	}
	if c.sc.Conn().IsClosed() {
		return nil, driver.ErrBadConn
	}
	begin := c.begin
	c.begin = ""
	values := make([]any, len(args))
	for i, a := range args {
		values[i] = a.Value
	}
	b := &pgx.Batch{}
	b.Queue(begin)
	b.Queue(query, values...)
	br := c.sc.Conn().SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		err = errors.Join(badConn(err), br.Close())
		c.abortIfNotBegun()
		return nil, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	return driver.RowsAffected(tag.RowsAffected()), nil
}

// QueryContext runs query after the pending BEGIN.
func (c *conn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if c.aborted {
		return nil, errAborted
	}
	if err := c.sendBegin(ctx); err != nil {
		return nil, err
	}
	return c.sc.QueryContext(ctx, query, args)
}

// PrepareContext prepares query. The statement runs through the connection, so that a pending
// BEGIN goes before it, also when database/sql runs it in a later transaction of the
// connection (Tx.Stmt of a statement prepared on the pool).
func (c *conn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	s, err := c.sc.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	return &stmt{Stmt: s, c: c, query: query}, nil
}

// Prepare is PrepareContext without a context.
func (c *conn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

// Begin is BeginTx with the default options.
func (c *conn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

// badConn marks err, a failure to begin a transaction on a connection that had none, as one
// that database/sql may try again on another connection, as pgx's driver does, when nothing
// of it reached the server.
func badConn(err error) error {
	if pgconn.SafeToRetry(err) {
		return errors.Join(err, driver.ErrBadConn)
	}
	return err
}

// tx is a transaction of conn.
type tx struct {
	c   *conn
	ctx context.Context
}

// Commit commits the transaction, as pgx's does: a transaction that failed is rolled back
// (pgx.ErrTxCommitRollback), and a connection left in a transaction by an error is closed.
func (t *tx) Commit() error {
	if t.c.aborted {
		t.c.aborted = false
		return pgx.ErrTxCommitRollback
	}
	if t.c.begin != "" {
		t.c.begin = "" // never begun: nothing to commit
		return nil
	}
	pc := t.c.sc.Conn()
	tag, err := pc.Exec(t.ctx, "commit")
	if err != nil {
		if pc.PgConn().TxStatus() != 'I' {
			_ = pc.Close(t.ctx)
		}
		return err
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// Rollback rolls the transaction back; a connection where that fails is closed.
func (t *tx) Rollback() error {
	if t.c.begin != "" || t.c.aborted {
		t.c.begin, t.c.aborted = "", false // never begun: nothing to roll back
		return nil
	}
	pc := t.c.sc.Conn()
	if _, err := pc.Exec(t.ctx, "rollback"); err != nil {
		_ = pc.Close(t.ctx)
		return err
	}
	return nil
}

// stmt is a statement prepared on conn. pgx's driver runs a prepared statement by its text,
// which names it on the server; so does stmt, through conn.
type stmt struct {
	driver.Stmt
	c     *conn
	query string
}

// ExecContext runs the statement, with the connection's pending BEGIN before it.
func (s *stmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	return s.c.ExecContext(ctx, s.query, args)
}

// QueryContext runs the statement after the connection's pending BEGIN.
func (s *stmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	return s.c.QueryContext(ctx, s.query, args)
}
