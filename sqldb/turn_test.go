package sqldb_test

import (
	"context"
	"database/sql/driver"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
)

// The transactions of this process over one SQLite file take turns before BEGIN: while one
// is open, another one's BeginTx, from any pool over the file, waits for it (and gives up when
// its context ends), and begins as soon as the first commits or rolls back.
func TestOpen_SQLiteTransactionsTakeTurnsAcrossPools(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "app.db")
	open := func() *sqldb.DB {
		db, err := sqldb.Open(ctx, "sqlite://"+path)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		return db
	}
	a, b := open(), open()
	_, err := a.ExecContext(ctx, `CREATE TABLE t (v INTEGER)`)
	require.NoError(t, err)

	require.False(t, sqldb.WriteTurnHeld(path))
	first, err := a.BeginTxx(ctx, nil)
	require.NoError(t, err)
	require.True(t, sqldb.WriteTurnHeld(path), "the open transaction has the turn")
	_, err = first.ExecContext(ctx, `INSERT INTO t VALUES (1)`)
	require.NoError(t, err)
	for _, db := range []*sqldb.DB{a, b} {
		waitCtx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		_, err := db.BeginTxx(waitCtx, nil)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, "waits for the open transaction")
	}
	begun := make(chan error, 1)
	go func() {
		tx, err := b.BeginTxx(ctx, nil)
		if err == nil {
			_, err = tx.ExecContext(ctx, `INSERT INTO t VALUES (2)`)
			err = joinCommit(tx.Commit(), err)
		}
		begun <- err
	}()
	require.NoError(t, first.Commit())
	select {
	case err := <-begun:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting transaction did not begin after the commit")
	}

	require.False(t, sqldb.WriteTurnHeld(path), "the commit gave the turn back")

	// A rollback gives the turn back too.
	tx, err := a.BeginTxx(ctx, nil)
	require.NoError(t, err)
	require.True(t, sqldb.WriteTurnHeld(path))
	require.NoError(t, tx.Rollback())
	require.False(t, sqldb.WriteTurnHeld(path))
	tx, err = b.BeginTxx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	var n int
	require.NoError(t, a.QueryRowContext(ctx, `SELECT count(*) FROM t`).Scan(&n))
	require.Equal(t, 2, n)
}

func joinCommit(commit, err error) error {
	if err != nil {
		return err
	}
	return commit
}

// A database whose transactions begin DEFERRED (they take the write lock at their first write,
// if any) takes no turns: its readers would wait for one another.
func TestOpen_SQLiteDeferredTransactionsTakeNoTurns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "app.db")
	db, err := sqldb.Open(ctx, "sqlite://"+path+"?_txlock=deferred")
	require.NoError(t, err)
	defer func() { require.NoError(t, db.Close()) }()
	tx, err := db.BeginTxx(ctx, nil)
	require.NoError(t, err)
	require.False(t, sqldb.WriteTurnHeld(path))
	require.NoError(t, tx.Rollback())
}

// database/sql rolls back a transaction whose context ended in a goroutine of its own, and
// then discards its connection; on a *sql.Conn, the next BeginTx can come first. It must fail
// with driver.ErrBadConn at once rather than wait for the turn that the unfinished
// transaction holds, while holding the connection its rollback needs.
func TestOpen_SQLiteBeginOnAConnectionWithAnUnfinishedTransactionFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "app.db")
	db, err := sqldb.Open(ctx, "sqlite://"+path)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	err = conn.Raw(func(dc any) error {
		b := dc.(driver.ConnBeginTx)
		first, err := b.BeginTx(ctx, driver.TxOptions{})
		require.NoError(t, err)
		require.True(t, sqldb.WriteTurnHeld(path))
		begun := time.Now()
		_, err = b.BeginTx(ctx, driver.TxOptions{})
		require.ErrorIs(t, err, driver.ErrBadConn)
		require.Less(t, time.Since(begun), time.Second, "the second BeginTx did not wait for the turn")
		require.NoError(t, first.Rollback())
		return nil
	})
	require.NoError(t, err)
	require.False(t, sqldb.WriteTurnHeld(path), "the rollback gave the turn back")
}
