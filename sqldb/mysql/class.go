package mysql

import (
	"errors"
	"strings"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/onceflow/onceflow/sqldb"
)

// MySQL and MariaDB server error numbers.
const (
	mysqlDupEntry            = 1062
	mysqlDupEntryWithKeyName = 1586
	mysqlLockWaitTimeout     = 1205 // also MariaDB's answer to NOWAIT and SKIP LOCKED waits
	mysqlDeadlock            = 1213
	mysqlLockNowait          = 3572 // MySQL 8: NOWAIT found the row locked
	mysqlQueryInterrupted    = 1317
	mysqlQueryTimeout        = 3024 // MySQL: max_execution_time exceeded
	mariadbStatementTimeout  = 1969 // MariaDB: max_statement_time exceeded
	mysqlServerShutdown      = 1053
	mysqlOptionPreventsStmt  = 1290 // --read-only (and other options that refuse a statement)
	mysqlReadOnlyTx          = 1792 // a write in a READ ONLY transaction
	mysqlSuperReadOnly       = 1836 // a write on a server in super_read_only mode
	mariadbConnectionKilled  = 1927
	mysqlBadNull             = 1048
	mysqlDataTooLong         = 1406
	mysqlOutOfRange          = 1264
	mysqlTruncatedWrongValue = 1292
	mysqlIncorrectValue      = 1366
	mysqlNoReferencedRow     = 1452
	mysqlRowIsReferenced     = 1451
	mysqlCheckViolated       = 3819
	mariadbCheckViolated     = 4025
)

// classify places an error that the MySQL or MariaDB server reported, by its number.
func classify(err error) (sqldb.Class, bool) {
	var myErr *gomysql.MySQLError
	if !errors.As(err, &myErr) {
		return sqldb.Unknown, false
	}
	switch myErr.Number {
	case mysqlDupEntry, mysqlDupEntryWithKeyName:
		return sqldb.UniqueViolation, true
	case mysqlLockWaitTimeout, mysqlDeadlock, mysqlLockNowait, mysqlQueryInterrupted, mysqlQueryTimeout,
		mariadbStatementTimeout:
		return sqldb.Conflict, true
	case mysqlServerShutdown, mariadbConnectionKilled:
		return sqldb.Connection, true
	case mysqlOptionPreventsStmt, mysqlReadOnlyTx, mysqlSuperReadOnly:
		return sqldb.ReadOnly, true
	case mysqlBadNull, mysqlDataTooLong, mysqlOutOfRange, mysqlTruncatedWrongValue, mysqlIncorrectValue,
		mysqlNoReferencedRow, mysqlRowIsReferenced, mysqlCheckViolated, mariadbCheckViolated:
		return sqldb.Data, true
	}
	return sqldb.Unknown, true
}

// isConnectionError reports go-sql-driver's error for a connection that broke in the
// middle of a request, which it returns instead of driver.ErrBadConn once data may have
// reached the server.
func isConnectionError(err error) bool {
	return errors.Is(err, gomysql.ErrInvalidConn)
}

// constraint reads the key name of a duplicate-entry error: "... for key 'name'" (MariaDB)
// or "... for key 'table.name'" (MySQL 8).
func constraint(err error) (string, bool) {
	var myErr *gomysql.MySQLError
	if !errors.As(err, &myErr) {
		return "", false
	}
	const marker = "for key '"
	i := strings.LastIndex(myErr.Message, marker)
	if i < 0 {
		return "", false
	}
	name := strings.TrimSuffix(myErr.Message[i+len(marker):], "'")
	if dot := strings.LastIndexByte(name, '.'); dot >= 0 {
		name = name[dot+1:]
	}
	return name, name != ""
}
