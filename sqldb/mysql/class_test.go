package mysql_test

import (
	"errors"
	"fmt"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
)

// TestClassify_ConstructedErrors covers error numbers that are rare or hard to provoke on a
// test server.
func TestClassify_ConstructedErrors(t *testing.T) {
	t.Parallel()
	my := func(n uint16) error { return &gomysql.MySQLError{Number: n} }
	for _, tc := range []struct {
		name string
		err  error
		want sqldb.Class
	}{
		{"duplicate entry", my(1062), sqldb.UniqueViolation},
		{"duplicate entry with key name", my(1586), sqldb.UniqueViolation},
		{"deadlock", my(1213), sqldb.Conflict},
		{"lock wait timeout", my(1205), sqldb.Conflict},
		{"mysql 8 NOWAIT", my(3572), sqldb.Conflict},
		{"mariadb max_statement_time", my(1969), sqldb.Conflict},
		{"mysql max_execution_time", my(3024), sqldb.Conflict},
		{"server shutdown", my(1053), sqldb.Connection},
		{"mariadb connection killed", my(1927), sqldb.Connection},
		{"mysql 8 check constraint", my(3819), sqldb.Data},
		{"mariadb check constraint", my(4025), sqldb.Data},
		{"syntax error", my(1064), sqldb.Unknown},
		{"invalid connection", gomysql.ErrInvalidConn, sqldb.Connection},
		{"wrapped twice", fmt.Errorf("a: %w", fmt.Errorf("b: %w", my(1062))), sqldb.UniqueViolation},
		{"joined", errors.Join(errors.New("rollback: tx done"), my(1213)), sqldb.Conflict},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Error(t, tc.err)
			require.Equal(t, tc.want, sqldb.Classify(tc.err), "Classify(%v)", tc.err)
		})
	}
}

func TestIsRetryable(t *testing.T) {
	t.Parallel()
	require.True(t, sqldb.IsRetryable(&gomysql.MySQLError{Number: 1213}))
	require.False(t, sqldb.IsRetryable(&gomysql.MySQLError{Number: 1062}))
	require.False(t, sqldb.IsRetryable(&gomysql.MySQLError{Number: 1406}))
}

func TestUniqueConstraint_ReadsTheKeyName(t *testing.T) {
	t.Parallel()
	for msg, want := range map[string]string{
		"Duplicate entry 'p-1' for key 'uq_payment_ref'":          "uq_payment_ref", // MariaDB
		"Duplicate entry 'p-1' for key 'payments.uq_payment_ref'": "uq_payment_ref", // MySQL 8
		"Duplicate entry 'p-1' for key 'PRIMARY'":                 "PRIMARY",
	} {
		name, ok := sqldb.UniqueConstraint(fmt.Errorf("insert: %w", &gomysql.MySQLError{Number: 1062, Message: msg}))
		require.True(t, ok, msg)
		require.Equal(t, want, name, msg)
	}
	_, ok := sqldb.UniqueConstraint(&gomysql.MySQLError{Number: 1062, Message: "Duplicate entry"})
	require.False(t, ok, "a message without the key names no constraint")
}
