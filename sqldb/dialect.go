package sqldb

import (
	"fmt"
)

// Dialect names an SQL dialect. The zero value is not a valid dialect.
type Dialect string

// The dialects onceflow supports.
const (
	Postgres Dialect = "postgres"
	MySQL    Dialect = "mysql"
	SQLite   Dialect = "sqlite"
)

// DialectOf returns the dialect of a database/sql driver name, as given to sql.Open.
func DialectOf(driverName string) (Dialect, error) {
	switch driverName {
	case "pgx", "pgx/v5", "postgres":
		return Postgres, nil
	case "mysql":
		return MySQL, nil
	case "sqlite", "sqlite3":
		return SQLite, nil
	}
	return "", fmt.Errorf("unsupported database driver %q (want pgx, mysql or sqlite)", driverName)
}

// String returns the dialect name.
func (d Dialect) String() string { return string(d) }
