package sqldb

import (
	"database/sql/driver"
	"time"
)

// ParseURL exposes parseURL to the tests of package sqldb_test, which import the drivers.
func ParseURL(rawURL string) (driverName, dsn, path, redacted string, connectTimeout time.Duration, err error) {
	t, err := parseURL(rawURL)
	if err != nil {
		return "", "", "", "", 0, err
	}
	return t.driver.DriverName, t.dsn, t.path, t.redacted, t.connectTimeout, nil
}

// WriteTurnHeld reports whether a transaction of this process has the turn to write the
// SQLite file at path.
func WriteTurnHeld(path string) bool { return len(writeTurn(path)) == 1 }

// BreakWriter breaks the connection that db's transactions run on, if it has one, as a
// connection lost under them would be.
func BreakWriter(db *DB) {
	db.w.mu.Lock()
	defer db.w.mu.Unlock()
	if db.w.conn != nil {
		_ = db.w.conn.Raw(func(any) error { return driver.ErrBadConn })
	}
}

// RegisteredParams returns the query parameters that the driver of dialect d registered, and
// what it makes of the others.
func RegisteredParams(d Dialect) (params []string, others string, ok bool) {
	for _, r := range drivers() {
		if r.Dialect == d {
			return r.Params, r.OtherParams, true
		}
	}
	return nil, "", false
}
