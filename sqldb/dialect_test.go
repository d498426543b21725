package sqldb_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
)

func TestDialectOf(t *testing.T) {
	t.Parallel()
	for driver, want := range map[string]sqldb.Dialect{
		"pgx": sqldb.Postgres, "pgx/v5": sqldb.Postgres, "postgres": sqldb.Postgres,
		"mysql":  sqldb.MySQL,
		"sqlite": sqldb.SQLite, "sqlite3": sqldb.SQLite,
	} {
		got, err := sqldb.DialectOf(driver)
		require.NoError(t, err, driver)
		require.Equal(t, want, got, driver)
	}
	for _, driver := range []string{"", "PGX", "oracle", "sqlserver"} {
		_, err := sqldb.DialectOf(driver)
		require.EqualError(t, err, `unsupported database driver "`+driver+`" (want pgx, mysql or sqlite)`)
	}
	require.Equal(t, "postgres", sqldb.Postgres.String())
	require.Equal(t, "mysql", sqldb.MySQL.String())
	require.Equal(t, "sqlite", sqldb.SQLite.String())
}
