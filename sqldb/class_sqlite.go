package sqldb

import (
	"errors"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

func classifySQLite(err error) (Class, bool) {
	var sqErr *sqlite.Error
	if !errors.As(err, &sqErr) {
		return Unknown, false
	}
	code := sqErr.Code()
	switch code {
	case sqlite3.SQLITE_CONSTRAINT_UNIQUE, sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY:
		return UniqueViolation, true
	}
	switch code & 0xff { // primary result code
	case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED:
		return Conflict, true
	case sqlite3.SQLITE_CONSTRAINT, sqlite3.SQLITE_MISMATCH, sqlite3.SQLITE_TOOBIG, sqlite3.SQLITE_RANGE:
		return Data, true
	}
	return Unknown, true
}
