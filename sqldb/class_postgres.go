package sqldb

import (
	"errors"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// classifyPostgres places an error that the PostgreSQL server reported, by its SQLSTATE.
func classifyPostgres(err error) (Class, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return Unknown, false
	}
	switch pgErr.Code {
	case pgerrcode.UniqueViolation:
		return UniqueViolation, true
	case pgerrcode.SerializationFailure, pgerrcode.DeadlockDetected, pgerrcode.LockNotAvailable,
		pgerrcode.TransactionRollback, pgerrcode.QueryCanceled:
		return Conflict, true
	case pgerrcode.AdminShutdown, pgerrcode.CrashShutdown, pgerrcode.CannotConnectNow,
		pgerrcode.IdleSessionTimeout, pgerrcode.IdleInTransactionSessionTimeout:
		return Connection, true
	}
	switch {
	case pgerrcode.IsConnectionException(pgErr.Code):
		return Connection, true
	case pgerrcode.IsTransactionRollback(pgErr.Code):
		return Conflict, true
	case pgerrcode.IsDataException(pgErr.Code), pgerrcode.IsIntegrityConstraintViolation(pgErr.Code):
		return Data, true
	case isFatal(pgErr):
		// The server ends the session after a FATAL or PANIC error, whatever its code: an
		// authentication failure, too many connections, a database that is being dropped.
		return Connection, true
	}
	return Unknown, true
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

// isPostgresConnectionError reports pgx's own errors for a connection that is closed, broken or
// timed out at the network level. pgx reports a connection that died while a request was in
// flight (during COMMIT, say) as pgconn.ErrConnClosed wrapped in an error that is not safe to
// retry; it reports a connection that was closed before a request was sent as safe to retry.
func isPostgresConnectionError(err error) bool {
	return errors.Is(err, pgconn.ErrConnClosed) || pgconn.SafeToRetry(err) || pgconn.Timeout(err)
}

func postgresConstraint(err error) (string, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.ConstraintName == "" {
		return "", false
	}
	return pgErr.ConstraintName, true
}
