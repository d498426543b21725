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
	// timeout, statement timeout, a busy SQLite database. Running the transaction again is the
	// cure.
	Conflict
	// Connection is a lost or refused connection. When it happens during COMMIT, the outcome
	// of the commit is unknown.
	Connection
	// Data is an error in the data that running again cannot cure: a value too long, a
	// NOT NULL or check or foreign-key violation, a malformed value.
	Data
	// ReadOnly is a database that refuses writes for now: a hot standby or a server in
	// read-only mode (a failover in progress, a maintenance), a read-only SQLite file. No
	// message is at fault; the database has to come back.
	ReadOnly
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
	case ReadOnly:
		return "read-only"
	}
	return "unknown"
}

// Classify places err in a Class. It asks the registered drivers (sqldb/postgres,
// sqldb/mysql, sqldb/sqlite), which look at SQLSTATE codes, MySQL error numbers, SQLite result
// codes and driver error values with errors.Is and errors.As, never at message text, so it
// works on wrapped and joined errors.
//
// An error the server reported decides the class by its code. Otherwise an error caused by a
// canceled or expired context is Unknown, even when the driver reports it through a closed
// connection: the caller ended the operation, the network did not fail. Otherwise an error of
// a broken, closed or refused connection is Connection, whether the driver or the network
// stack reports it. The nil error is Unknown.
func Classify(err error) Class {
	if err == nil {
		return Unknown
	}
	ds := drivers()
	for _, d := range ds {
		if c, ok := d.Classify(err); ok {
			return c
		}
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return Unknown
	}
	for _, d := range ds {
		if d.IsConnectionError != nil && d.IsConnectionError(err) {
			return Connection
		}
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

// isConnectionError reports the driver-independent signs of a broken connection.
func isConnectionError(err error) bool {
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNABORTED) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed) {
		return true
	}
	var netErr net.Error
	return errors.As(err, &netErr)
}

// IsOutage reports whether err is a failure of the world around a message rather than of the
// message: the database unreachable, refusing connections or writes (class Connection or
// ReadOnly), or an error that says so of itself with a method Outage() bool that returns
// true (a dead-letter broker that refuses every message, say). It decides by behaviour, as
// Classify does: on wrapped and joined errors, never by message text. Running the message
// again cannot fail any differently until the outage is over: a consumer stops taking
// messages, waits for the outage to end (Probe), and does not count the failed delivery
// against the message's delivery limit. A canceled or expired context is not an outage.
func IsOutage(err error) bool {
	if err == nil {
		return false
	}
	var o interface{ Outage() bool }
	if errors.As(err, &o) && o.Outage() {
		return true
	}
	switch Classify(err) {
	case Connection, ReadOnly:
		return true
	}
	return false
}

// Probe asks db a cheap question (SELECT 1) and returns the error it gets, which is nil once
// the database answers again: the way back from an outage (IsOutage). A database that answers
// but refuses writes (ReadOnly) passes the probe; the next write tells.
//
// After an outage the pool's idle connections are dead, and a driver may find that out only
// by using one: Probe asks again, at once, while it fails on a connection, up to once per idle
// connection and once more, so that it uses up the dead ones and the transactions after it get
// live connections.
func Probe(ctx context.Context, db *DB) error {
	tries := db.Stats().Idle + 1
	var err error
	for range tries {
		var one int
		if err = db.QueryRowContext(ctx, "SELECT 1").Scan(&one); err == nil || !IsOutage(err) || ctx.Err() != nil {
			return err
		}
	}
	return err
}

// UniqueConstraint returns the constraint that a unique violation err broke, as the database
// names it, and whether err is a unique violation that names one:
//
//	PostgreSQL       the constraint or unique index name ("payments_pkey")
//	MySQL, MariaDB   the key name ("PRIMARY", "uq_payment_ref"), without the table prefix MySQL 8 adds
//	SQLite           the columns, as SQLite reports them ("payments.payment_id", or
//	                 "t.a, t.b" for a key of two columns)
//
// PostgreSQL reports the name in a field of its own; MySQL and SQLite only in the message
// text, which this function reads for that name alone. A row that violates several unique
// constraints at once is reported with one of them, the first the database checked: name every
// constraint that an earlier delivery of the same message would violate. MariaDB gives key names
// without their table, and every primary key is "PRIMARY" there: give the unique keys that mean
// "already processed" names of their own.
func UniqueConstraint(err error) (string, bool) {
	if Classify(err) != UniqueViolation {
		return "", false
	}
	for _, d := range drivers() {
		if d.UniqueConstraint == nil {
			continue
		}
		if name, ok := d.UniqueConstraint(err); ok {
			return name, true
		}
	}
	return "", false
}
