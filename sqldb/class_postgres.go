package sqldb

import (
	"errors"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

func classifyPostgres(err error) (Class, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		if pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
			return Connection, true
		}
		return Unknown, false
	}
	switch pgErr.Code {
	case pgerrcode.UniqueViolation:
		return UniqueViolation, true
	case pgerrcode.SerializationFailure, pgerrcode.DeadlockDetected, pgerrcode.LockNotAvailable,
		pgerrcode.TransactionRollback, pgerrcode.QueryCanceled:
		return Conflict, true
	case pgerrcode.AdminShutdown, pgerrcode.CrashShutdown, pgerrcode.CannotConnectNow:
		return Connection, true
	}
	switch {
	case pgerrcode.IsConnectionException(pgErr.Code):
		return Connection, true
	case pgerrcode.IsTransactionRollback(pgErr.Code):
		return Conflict, true
	case pgerrcode.IsDataException(pgErr.Code), pgerrcode.IsIntegrityConstraintViolation(pgErr.Code):
		return Data, true
	}
	return Unknown, true
}
