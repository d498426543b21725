package scratch_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/examples/internal/scratch"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// A run's database on a server starts empty, is not the database the URL named, and is gone
// after drop.
func TestDatabase_OnAServerIsTheRunsOwnAndDropped(t *testing.T) {
	ctx := context.Background()
	for name, base := range map[string]func(testing.TB) string{"postgres": testsvc.PostgresSchemaURL, "mysql": testsvc.MySQLDatabaseURL} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			baseURL := base(t)
			shared, err := sqldb.Open(ctx, baseURL)
			require.NoError(t, err)
			defer shared.Close()
			_, err = shared.ExecContext(ctx, `CREATE TABLE ledger (id INTEGER)`)
			require.NoError(t, err)

			runURL, drop, err := scratch.Database(ctx, baseURL, t.TempDir())
			require.NoError(t, err)
			require.NotEqual(t, baseURL, runURL)
			db, err := sqldb.Open(ctx, runURL)
			require.NoError(t, err)
			exists, err := db.TableExists(ctx, "ledger")
			require.NoError(t, err)
			require.False(t, exists, "the run's database holds none of the shared one's tables")
			_, err = db.ExecContext(ctx, `CREATE TABLE ledger (id INTEGER)`)
			require.NoError(t, err)
			require.NoError(t, db.Close())

			require.NoError(t, drop())
			_, err = sqldb.OpenExisting(ctx, runURL)
			if name == "mysql" {
				require.Error(t, err, "the run's database is dropped")
			} else {
				db, err := sqldb.Open(ctx, runURL)
				require.NoError(t, err)
				defer db.Close()
				var n int
				require.NoError(t, db.GetContext(ctx, &n, `SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name = current_setting('search_path')`))
				require.Zero(t, n, "the run's schema is dropped")
			}
			exists, err = shared.TableExists(ctx, "ledger")
			require.NoError(t, err)
			require.True(t, exists, "the shared database keeps its tables")
		})
	}
}

// An SQLite URL is the run's own file already; an empty URL is app.db in the directory.
func TestDatabase_SQLiteIsUsedAsItIs(t *testing.T) {
	dir := t.TempDir()
	runURL, drop, err := scratch.Database(context.Background(), "", dir)
	require.NoError(t, err)
	require.Equal(t, "sqlite://"+dir+"/app.db", runURL)
	require.NoError(t, drop())
}
