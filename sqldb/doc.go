// Package sqldb opens the application database from a URL, names its SQL dialect, and
// classifies driver errors by behaviour.
//
// Three dialects are supported: PostgreSQL (through pgx), MySQL and MariaDB (through
// go-sql-driver/mysql) and SQLite (through modernc.org/sqlite, pure Go, the embedded default).
// Everything dialect-specific in onceflow's core goes through this package: the rest speaks of
// a DB, a Dialect and an error Class.
//
// The package itself links no database driver. Each driver is a package of its own that
// registers itself (Register), as a database/sql driver does; a program imports those it
// opens, and links no other:
//
//	import _ "github.com/onceflow/onceflow/sqldb/postgres" // postgres://, postgresql://
//	import _ "github.com/onceflow/onceflow/sqldb/mysql"    // mysql://, mariadb://
//	import _ "github.com/onceflow/onceflow/sqldb/sqlite"   // sqlite://, sqlite3://
//
// Open fails with an error naming the import when a URL's driver is missing.
//
// Errors are classified by SQLSTATE code, MySQL error number or SQLite result code, never by
// message text; see Classify.
package sqldb
