package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
)

// code returns the SQLSTATE of err, or "" when err carries none.
func code(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// requireClass asserts the class of err.
func requireClass(t testing.TB, want sqldb.Class, err error) {
	t.Helper()
	require.Error(t, err)
	require.Equal(t, want, sqldb.Classify(err), "Classify(%v)", err)
}

func mustExec(t testing.TB, db *sqldb.DB, query string, args ...any) {
	t.Helper()
	_, err := db.ExecContext(context.Background(), db.Rebind(query), args...)
	require.NoError(t, err, query)
}

func count(t testing.TB, db *sqldb.DB, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowxContext(context.Background(), db.Rebind(query), args...).Scan(&n), query)
	return n
}

// sessionID returns the server's id of the session that tx runs on.
func sessionID(t testing.TB, tx interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}) int64 {
	t.Helper()
	var id int64
	require.NoError(t, tx.QueryRowContext(context.Background(), "SELECT pg_backend_pid()").Scan(&id))
	return id
}
