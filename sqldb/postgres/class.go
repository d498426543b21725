package postgres

import (
	"errors"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceflow/onceflow/sqldb"
)

// classify places an error that the PostgreSQL server reported, by its SQLSTATE.
func classify(err error) (sqldb.Class, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return sqldb.Unknown, false
	}
	switch pgErr.Code {
	case pgerrcode.UniqueViolation:
		return sqldb.UniqueViolation, true
	case pgerrcode.SerializationFailure, pgerrcode.DeadlockDetected, pgerrcode.LockNotAvailable,
		pgerrcode.TransactionRollback, pgerrcode.QueryCanceled:
		return sqldb.Conflict, true
	case pgerrcode.ReadOnlySQLTransaction:
		return sqldb.ReadOnly, true
	case pgerrcode.AdminShutdown, pgerrcode.CrashShutdown, pgerrcode.CannotConnectNow,
		pgerrcode.IdleSessionTimeout, pgerrcode.IdleInTransactionSessionTimeout:
		return sqldb.Connection, true
	}
	switch {
	case pgerrcode.IsConnectionException(pgErr.Code):
		return sqldb.Connection, true
	case pgerrcode.IsTransactionRollback(pgErr.Code):
		return sqldb.Conflict, true
	case pgerrcode.IsDataException(pgErr.Code), pgerrcode.IsIntegrityConstraintViolation(pgErr.Code):
		return sqldb.Data, true
	case isFatal(pgErr):
		// The server ends the session after a FATAL or PANIC error, whatever its code: an
		// authentication failure, too many connections, a database that is being dropped.
		return sqldb.Connection, true
	}
	return sqldb.Unknown, true
}

// isFatal reports whether the server ended the session with the error. It reads the severity
// field of the protocol message, which the server never translates.
func isFatal(pgErr *pgconn.PgError) bool {
	severity := pgErr.SeverityUnlocalized
	if severity == "" { // servers before 9.6 send only the localized field
		severity = pgErr.Severity
	}
	return severity == "FATAL" || severity == "PANIC"
}

// isConnectionError reports pgx's own errors for a connection that is closed, broken or
// timed out at the network level. pgx reports a connection that died while a request was in
// flight (during COMMIT, say) as pgconn.ErrConnClosed wrapped in an error that is not safe to
// retry; it reports a connection that was closed before a request was sent as safe to retry.
func isConnectionError(err error) bool {
	return errors.Is(err, pgconn.ErrConnClosed) || pgconn.SafeToRetry(err) || pgconn.Timeout(err)
}

// constraint returns the name of the constraint or unique index that a unique violation broke,
// which PostgreSQL reports in a field of its own.
func constraint(err error) (string, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.ConstraintName == "" {
		return "", false
	}
	return pgErr.ConstraintName, true
}
