package sqlite_test

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	modernc "modernc.org/sqlite"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// code returns the extended result code of err, or "" when err carries none.
func code(err error) string {
	var sqErr *modernc.Error
	if errors.As(err, &sqErr) {
		return strconv.Itoa(sqErr.Code())
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
	_, err := db.ExecContext(context.Background(), query, args...)
	require.NoError(t, err, query)
}

func TestClassify_SQLiteBusyIsConflict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sqldb.Open(ctx, testsvc.SQLiteURL(t)+"?_pragma=busy_timeout(10)")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	mustExec(t, db, "CREATE TABLE outbox (id INTEGER PRIMARY KEY)")

	holder, err := db.BeginTxx(ctx, nil) // BEGIN IMMEDIATE: holds the write lock from here on
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback() })

	t.Run("write on a second connection", func(t *testing.T) {
		_, err := db.ExecContext(ctx, "INSERT INTO outbox (id) VALUES (1)")
		requireClass(t, sqldb.Conflict, err)
		require.Equal(t, "5", code(err)) // SQLITE_BUSY
		require.True(t, sqldb.IsRetryable(err))
	})
	t.Run("second transaction", func(t *testing.T) {
		_, err := db.BeginTxx(ctx, nil)
		requireClass(t, sqldb.Conflict, err)
		require.Equal(t, "5", code(err))
	})
}

func TestUniqueConstraint_ReadsTheColumns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sqldb.Open(ctx, testsvc.SQLiteURL(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	mustExec(t, db, "CREATE TABLE payments (payment_id TEXT PRIMARY KEY, a INTEGER, b INTEGER, UNIQUE (a, b))")
	mustExec(t, db, "INSERT INTO payments (payment_id, a, b) VALUES ('p1', 1, 2)")

	_, err = db.ExecContext(ctx, "INSERT INTO payments (payment_id, a, b) VALUES ('p1', 3, 4)")
	name, ok := sqldb.UniqueConstraint(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, "payments.payment_id", name)
	_, err = db.ExecContext(ctx, "INSERT INTO payments (payment_id, a, b) VALUES ('p2', 1, 2)")
	name, ok = sqldb.UniqueConstraint(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, "payments.a, payments.b", name)
}
