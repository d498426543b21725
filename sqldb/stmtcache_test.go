package sqldb_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
)

// The connections of an SQLite file run the statements they ran before compiled: the same
// text may run again while its rows are open, and rows keep the driver's column types.
func TestOpen_SQLiteStatementsRunAgainWhileTheirRowsAreOpen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(t.TempDir(), "app.db"))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	_, err = db.ExecContext(ctx, `CREATE TABLE t (v INTEGER NOT NULL, s TEXT)`)
	require.NoError(t, err)
	tx, err := db.BeginTxx(ctx, nil)
	require.NoError(t, err)
	for v := range 3 {
		_, err := tx.ExecContext(ctx, `INSERT INTO t (v, s) VALUES (?, ?)`, v, "x")
		require.NoError(t, err)
	}
	const query = `SELECT v FROM t WHERE v >= ? ORDER BY v`
	outer, err := tx.QueryContext(ctx, query, 0)
	require.NoError(t, err)
	types, err := outer.ColumnTypes()
	require.NoError(t, err)
	require.Equal(t, "INTEGER", types[0].DatabaseTypeName())
	var pairs [][2]int
	for outer.Next() {
		var v int
		require.NoError(t, outer.Scan(&v))
		inner, err := tx.QueryContext(ctx, query, v) // the same text, its rows open
		require.NoError(t, err)
		for inner.Next() {
			var w int
			require.NoError(t, inner.Scan(&w))
			pairs = append(pairs, [2]int{v, w})
		}
		require.NoError(t, inner.Err())
		require.NoError(t, inner.Close())
	}
	require.NoError(t, outer.Err())
	require.NoError(t, outer.Close())
	require.Equal(t, [][2]int{{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 2}, {2, 2}}, pairs)
	require.NoError(t, tx.Commit())

	_, err = db.ExecContext(ctx, `INSERT INTO missing VALUES (1)`)
	require.ErrorContains(t, err, "no such table", "a statement that does not compile reports the driver's error")
}
