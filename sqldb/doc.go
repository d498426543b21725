// Package sqldb opens the application database from a URL, names its SQL dialect, and
// classifies driver errors by behaviour.
//
// Three dialects are supported: PostgreSQL (through pgx), MySQL and MariaDB (through
// go-sql-driver/mysql) and SQLite (through modernc.org/sqlite, pure Go, the embedded default).
// Everything dialect-specific in onceflow's core goes through this package: the rest speaks of
// a DB, a Dialect and an error Class.
//
// Errors are classified by SQLSTATE code, MySQL error number or SQLite result code, never by
// message text; see Classify.
package sqldb
