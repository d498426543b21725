package sqldb

import (
	"context"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"syscall"
)

// Class is the behaviour an error calls for.
type Class int

const (
	// Unknown is an error this package cannot place. Callers treat it as transient.
	Unknown Class = iota
	// UniqueViolation is a unique or primary-key constraint violation: the row exists already.
	UniqueViolation
	// Conflict is a transient concurrency failure: serialization failure, deadlock, lock wait
	// timeout, a busy SQLite database. Running the transaction again is the cure.
	Conflict
	// Connection is a lost or refused connection. When it happens during COMMIT, the outcome
	// of the commit is unknown.
	Connection
	// Data is an error in the data that running again cannot cure: a value too long, a
	// NOT NULL or check or foreign-key violation, a malformed value.
	Data
)

// String names the class.
func (c Class) String() string {
	switch c {
	case UniqueViolation:
		return "unique violation"
	case Conflict:
		return "conflict"
	case Connection:
		return "connection"
	case Data:
		return "data"
	}
	return "unknown"
}

// Classify places err, returned by any of the supported drivers, in a Class. It looks at
// SQLSTATE codes, MySQL error numbers and SQLite result codes with errors.As, so it works on
// wrapped errors.
func Classify(err error) Class {
	if err == nil {
		return Unknown
	}
	if c, ok := classifyPostgres(err); ok {
		return c
	}
	if c, ok := classifyMySQL(err); ok {
		return c
	}
	if c, ok := classifySQLite(err); ok {
		return c
	}
	if isConnectionError(err) {
		return Connection
	}
	return Unknown
}

// IsUniqueViolation reports whether err is a unique or primary-key violation.
func IsUniqueViolation(err error) bool { return Classify(err) == UniqueViolation }

// IsRetryable reports whether running the transaction again may succeed: a conflict, a lost
// connection, or an error of unknown class. Unique violations and data errors are not
// retryable.
func IsRetryable(err error) bool {
	switch Classify(err) {
	case UniqueViolation, Data:
		return false
	}
	return err != nil
}

func isConnectionError(err error) bool {
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, net.ErrClosed) {
		return true
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var netErr net.Error
	return errors.As(err, &netErr)
}
