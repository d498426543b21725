package sqldb

import (
	"errors"
	"strings"

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

// sqliteConstraint reads the columns of a unique violation: "UNIQUE constraint failed:
// table.column[, table.column]".
func sqliteConstraint(err error) (string, bool) {
	var sqErr *sqlite.Error
	if !errors.As(err, &sqErr) {
		return "", false
	}
	const marker = "UNIQUE constraint failed: "
	text := sqErr.Error()
	i := strings.Index(text, marker)
	if i < 0 {
		return "", false
	}
	cols := text[i+len(marker):]
	if j := strings.Index(cols, " ("); j >= 0 { // the result code modernc appends
		cols = cols[:j]
	}
	return cols, cols != ""
}
