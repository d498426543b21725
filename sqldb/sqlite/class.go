package sqlite

import (
	"errors"
	"strings"

	modernc "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/onceflow/onceflow/sqldb"
)

// classify places an error that SQLite reported, by its extended result code.
func classify(err error) (sqldb.Class, bool) {
	var sqErr *modernc.Error
	if !errors.As(err, &sqErr) {
		return sqldb.Unknown, false
	}
	code := sqErr.Code()
	switch code {
	case sqlite3.SQLITE_CONSTRAINT_UNIQUE, sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY:
		return sqldb.UniqueViolation, true
	}
	switch code & 0xff { // primary result code
	case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED:
		return sqldb.Conflict, true
	case sqlite3.SQLITE_READONLY:
		return sqldb.ReadOnly, true
	case sqlite3.SQLITE_CONSTRAINT, sqlite3.SQLITE_MISMATCH, sqlite3.SQLITE_TOOBIG, sqlite3.SQLITE_RANGE:
		return sqldb.Data, true
	}
	return sqldb.Unknown, true
}

// constraint reads the columns of a unique violation: "UNIQUE constraint failed:
// table.column[, table.column]".
func constraint(err error) (string, bool) {
	var sqErr *modernc.Error
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
