package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// TestClassify_ConstructedErrors covers codes that are rare or hard to provoke on a test
// server.
func TestClassify_ConstructedErrors(t *testing.T) {
	t.Parallel()
	pg := func(code string) error { return &pgconn.PgError{Severity: "ERROR", Code: code} }
	pgFatal := func(code string) error {
		return &pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: code}
	}
	for _, tc := range []struct {
		name string
		err  error
		want sqldb.Class
	}{
		{"unique_violation", pg("23505"), sqldb.UniqueViolation},
		{"serialization_failure", pg("40001"), sqldb.Conflict},
		{"deadlock_detected", pg("40P01"), sqldb.Conflict},
		{"transaction_rollback", pg("40000"), sqldb.Conflict},
		{"lock_not_available", pg("55P03"), sqldb.Conflict},
		{"query_canceled", pg("57014"), sqldb.Conflict},
		{"admin_shutdown", pgFatal("57P01"), sqldb.Connection},
		{"crash_shutdown", pgFatal("57P02"), sqldb.Connection},
		{"cannot_connect_now", pgFatal("57P03"), sqldb.Connection},
		{"idle_session_timeout", pgFatal("57P05"), sqldb.Connection},
		{"idle_in_transaction_session_timeout", pgFatal("25P03"), sqldb.Connection},
		{"connection_failure", pg("08006"), sqldb.Connection},
		{"too_many_connections", pgFatal("53300"), sqldb.Connection},
		{"string_data_right_truncation", pg("22001"), sqldb.Data},
		{"not_null_violation", pg("23502"), sqldb.Data},
		{"foreign_key_violation", pg("23503"), sqldb.Data},
		{"syntax_error", pg("42601"), sqldb.Unknown},
		{"connection closed", pgconn.ErrConnClosed, sqldb.Connection},
		{"wrapped twice", fmt.Errorf("a: %w", fmt.Errorf("b: %w", pg("23505"))), sqldb.UniqueViolation},
		{"joined", errors.Join(errors.New("rollback: tx done"), pg("40P01")), sqldb.Conflict},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			requireClass(t, tc.want, tc.err)
		})
	}
}

func TestIsRetryable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&pgconn.PgError{Code: "23505"}, false},
		{&pgconn.PgError{Code: "22001"}, false},
		{&pgconn.PgError{Code: "40001"}, true},
	} {
		require.Equal(t, tc.want, sqldb.IsRetryable(tc.err), "IsRetryable(%v)", tc.err)
	}
}

func TestUniqueConstraint_NamesTheConstraint(t *testing.T) {
	t.Parallel()
	name, ok := sqldb.UniqueConstraint(fmt.Errorf("insert: %w", &pgconn.PgError{Code: "23505", ConstraintName: "payments_pkey"}))
	require.True(t, ok)
	require.Equal(t, "payments_pkey", name)
	_, ok = sqldb.UniqueConstraint(&pgconn.PgError{Code: "23503", ConstraintName: "payments_account_fkey"})
	require.False(t, ok, "a foreign-key violation is not a unique violation")
}

func TestClassify_PostgresSerializationFailureIsConflict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	setup := func(t *testing.T) *sqldb.DB {
		db := testsvc.Postgres(t)
		mustExec(t, db, "CREATE TABLE doctor (id INT PRIMARY KEY, on_call BOOLEAN NOT NULL)")
		mustExec(t, db, "INSERT INTO doctor (id, on_call) VALUES (1, true), (2, true)")
		return db
	}

	t.Run("repeatable read, concurrent update", func(t *testing.T) {
		t.Parallel()
		db := setup(t)
		tx, err := db.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback() })
		var onCall bool
		require.NoError(t, tx.QueryRowContext(ctx, "SELECT on_call FROM doctor WHERE id = 1").Scan(&onCall)) // takes the snapshot
		mustExec(t, db, "UPDATE doctor SET on_call = false WHERE id = 1")

		_, err = tx.ExecContext(ctx, "UPDATE doctor SET on_call = true WHERE id = 1")
		requireClass(t, sqldb.Conflict, err)
		require.Equal(t, "40001", code(err))
	})

	t.Run("serializable write skew, at commit", func(t *testing.T) {
		t.Parallel()
		db := setup(t)
		begin := func() *sql.Tx {
			tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable})
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback() })
			var n int
			require.NoError(t, tx.QueryRowContext(ctx, "SELECT count(*) FROM doctor WHERE on_call").Scan(&n))
			require.Equal(t, 2, n)
			return tx
		}
		tx1, tx2 := begin(), begin()
		_, err := tx1.ExecContext(ctx, "UPDATE doctor SET on_call = false WHERE id = 1")
		require.NoError(t, err)
		_, err = tx2.ExecContext(ctx, "UPDATE doctor SET on_call = false WHERE id = 2")
		require.NoError(t, err)
		require.NoError(t, tx1.Commit())

		err = tx2.Commit()
		requireClass(t, sqldb.Conflict, err)
		require.Equal(t, "40001", code(err))
	})
}

func TestClassify_PostgresIdleInTransactionTimeoutIsConnection(t *testing.T) {
	t.Parallel()
	db := testsvc.Postgres(t)
	ctx := context.Background()
	tx, err := db.BeginTxx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	id := sessionID(t, tx)
	_, err = tx.ExecContext(ctx, "SET LOCAL idle_in_transaction_session_timeout = '10ms'")
	require.NoError(t, err)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return count(t, db, "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?", id) == 0
	}, "session %d outlived idle_in_transaction_session_timeout", id)

	_, err = tx.ExecContext(ctx, "SELECT 1")
	requireClass(t, sqldb.Connection, err)
	require.Equal(t, "25P03", code(err))
}
