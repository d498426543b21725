package sqldb

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// countingConn is a driver connection that counts the statements it compiles and closes.
type countingConn struct {
	driver.Conn
	prepared, closed int
}

func (c *countingConn) PrepareContext(_ context.Context, query string) (driver.Stmt, error) {
	if query == "bad" {
		return nil, errors.New("syntax error")
	}
	c.prepared++
	return &countingStmt{c: c}, nil
}

type countingStmt struct {
	driver.Stmt
	c *countingConn
}

func (s *countingStmt) Close() error { s.c.closed++; return nil }

func (s *countingStmt) ExecContext(context.Context, []driver.NamedValue) (driver.Result, error) {
	return driver.RowsAffected(1), nil
}

func (s *countingStmt) QueryContext(context.Context, []driver.NamedValue) (driver.Rows, error) {
	return emptyRows{}, nil
}

type emptyRows struct{}

func (emptyRows) Columns() []string         { return nil }
func (emptyRows) Close() error              { return nil }
func (emptyRows) Next([]driver.Value) error { return errors.New("no rows") }

// mustExec runs text through c, which must run it compiled.
func mustExec(t *testing.T, c *stmtCache, conn driver.Conn, text string) {
	t.Helper()
	_, ok, err := c.exec(context.Background(), conn, text, nil)
	require.True(t, ok, "%s runs compiled", text)
	require.NoError(t, err)
}

// mustQuery queries text through c, which must run it compiled, and returns its open rows.
func mustQuery(t *testing.T, c *stmtCache, conn driver.Conn, text string) driver.Rows {
	t.Helper()
	rows, ok, err := c.query(context.Background(), conn, text, nil)
	require.True(t, ok, "%s runs compiled", text)
	require.NoError(t, err)
	return rows
}

func TestStmtCache_CompilesAStatementOnceAndRunsItAgain(t *testing.T) {
	conn := &countingConn{}
	var c stmtCache
	for range 3 {
		mustExec(t, &c, conn, "INSERT")
		require.NoError(t, mustQuery(t, &c, conn, "SELECT").Close())
	}
	require.Equal(t, 2, conn.prepared, "one compile per text")
	c.close()
	require.Equal(t, 2, conn.closed)
}

func TestStmtCache_ABusyStatementIsNotRunAgainUntilItsRowsClose(t *testing.T) {
	conn := &countingConn{}
	var c stmtCache
	rows := mustQuery(t, &c, conn, "SELECT")
	_, ok, _ := c.query(context.Background(), conn, "SELECT", nil)
	require.False(t, ok, "its rows are open: the caller runs it the usual way")
	require.NoError(t, rows.Close())
	require.NoError(t, mustQuery(t, &c, conn, "SELECT").Close())
	require.Equal(t, 1, conn.prepared)
}

func TestStmtCache_KeepsTheMostRecentlyUsedAndClosesAnEvictedStatementWhenItIsFree(t *testing.T) {
	conn := &countingConn{}
	var c stmtCache
	open := mustQuery(t, &c, conn, "SELECT 0")
	for i := 1; i <= stmtCacheSize; i++ {
		mustExec(t, &c, conn, fmt.Sprintf("INSERT %d", i))
	}
	require.Equal(t, stmtCacheSize, c.lru.Len())
	require.Zero(t, conn.closed, "the evicted statement's rows are open")
	require.NoError(t, open.Close())
	require.Equal(t, 1, conn.closed, "closed with its rows")
	mustExec(t, &c, conn, "INSERT 2")
	require.Equal(t, stmtCacheSize+1, conn.prepared, "INSERT 2 is still compiled")
}

func TestStmtCache_AStatementThatDoesNotCompileIsLeftToTheCaller(t *testing.T) {
	conn := &countingConn{}
	var c stmtCache
	_, ok, err := c.exec(context.Background(), conn, "bad", nil)
	require.False(t, ok, "the usual way reports the driver's error")
	require.NoError(t, err)
	require.Zero(t, c.lru.Len())
}
