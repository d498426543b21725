package sqldb_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
)

// openSQLite opens a pool over a new SQLite file, closed when the test ends, with the table
// t (v INTEGER).
func openSQLite(t *testing.T) *sqldb.DB {
	t.Helper()
	db, err := sqldb.Open(context.Background(), "sqlite://"+filepath.Join(t.TempDir(), "app.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	_, err = db.Exec(`CREATE TABLE t (v INTEGER)`)
	require.NoError(t, err)
	return db
}

// markConnection creates, in a transaction of db, a table that only the connection it ran on
// sees; onMarked reports whether a transaction of db runs on that connection.
func markConnection(t *testing.T, db *sqldb.DB) (onMarked func() bool) {
	t.Helper()
	tx, err := db.BeginTxx(context.Background(), nil)
	require.NoError(t, err)
	_, err = tx.Exec(`CREATE TEMP TABLE mark (x INTEGER)`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	return func() bool {
		tx, err := db.BeginTxx(context.Background(), nil)
		require.NoError(t, err)
		defer func() { require.NoError(t, tx.Rollback()) }()
		var n int
		return tx.QueryRow(`SELECT count(*) FROM temp.sqlite_master WHERE name = 'mark'`).Scan(&n) == nil && n == 1
	}
}

// The transactions of a pool over an SQLite file, from any goroutine, all run on one
// connection, whose page cache the one before left warm; statements outside transactions
// run on the others meanwhile.
func TestOpen_SQLiteTransactionsRunOnOneConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openSQLite(t)
	onMarked := markConnection(t, db)

	var wg sync.WaitGroup
	errs := make(chan error, 8*25)
	for g := range 8 {
		wg.Go(func() {
			for i := range 25 {
				tx, err := db.BeginTxx(ctx, nil)
				if err != nil {
					errs <- err
					return
				}
				var n int
				if err := tx.QueryRow(`SELECT count(*) FROM temp.sqlite_master WHERE name = 'mark'`).Scan(&n); err != nil || n != 1 {
					errs <- joinCommit(tx.Rollback(), err)
					t.Errorf("a transaction ran on another connection (%d marks)", n)
					return
				}
				_, err = tx.Exec(`INSERT INTO t VALUES (?)`, g*100+i)
				errs <- joinCommit(tx.Commit(), err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	var rows int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM t`).Scan(&rows))
	require.Equal(t, 8*25, rows)

	open, err := db.BeginTxx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM t`).Scan(&rows), "a statement outside the open transaction")
	require.NoError(t, open.Rollback())
	require.True(t, onMarked())
}

// A pool of fewer than four connections holds none for its transactions: its statements
// outside them would have too few.
func TestOpen_SQLiteSmallPoolHoldsNoConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openSQLite(t)
	onMarked := markConnection(t, db)
	require.True(t, onMarked())
	db.SetMaxOpenConns(1)
	for i := range 3 {
		tx, err := db.BeginTxx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.Exec(`INSERT INTO t VALUES (?)`, i)
		require.NoError(t, err)
		require.NoError(t, tx.Commit())
		var n int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM t`).Scan(&n))
		require.Equal(t, i+1, n)
	}
}

// When the connection of the transactions breaks, the next transaction takes another.
func TestOpen_SQLiteBrokenConnectionIsReplaced(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openSQLite(t)
	onMarked := markConnection(t, db)
	sqldb.BreakWriter(db)
	tx, err := db.BeginTxx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.Exec(`INSERT INTO t VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	require.False(t, onMarked(), "the marked connection is gone")
	require.False(t, sqldb.WriteTurnHeld(db.Path))
}

// Close gives the connection of the transactions back, and the pool closes.
func TestOpen_SQLiteCloseEndsTheTransactionsConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openSQLite(t)
	markConnection(t, db)
	require.NoError(t, db.Close())
	_, err := db.BeginTxx(ctx, nil)
	require.ErrorContains(t, err, "database is closed")
	require.False(t, sqldb.WriteTurnHeld(db.Path))
	require.Zero(t, db.Stats().OpenConnections)
}
