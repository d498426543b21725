package sqldb

import (
	"errors"

	"github.com/go-sql-driver/mysql"
)

// MySQL and MariaDB server error numbers.
const (
	mysqlDupEntry            = 1062
	mysqlDupEntryWithKeyName = 1586
	mysqlLockWaitTimeout     = 1205
	mysqlDeadlock            = 1213
	mysqlLockNowait          = 3572
	mysqlQueryInterrupted    = 1317
	mysqlServerShutdown      = 1053
	mysqlConnectionKilled    = 1927
	mysqlBadNull             = 1048
	mysqlDataTooLong         = 1406
	mysqlOutOfRange          = 1264
	mysqlTruncatedWrongValue = 1292
	mysqlIncorrectValue      = 1366
	mysqlNoReferencedRow     = 1452
	mysqlRowIsReferenced     = 1451
	mysqlCheckViolated       = 3819
	mysqlCheckViolatedMaria  = 4025
)

func classifyMySQL(err error) (Class, bool) {
	if errors.Is(err, mysql.ErrInvalidConn) {
		return Connection, true
	}
	var myErr *mysql.MySQLError
	if !errors.As(err, &myErr) {
		return Unknown, false
	}
	switch myErr.Number {
	case mysqlDupEntry, mysqlDupEntryWithKeyName:
		return UniqueViolation, true
	case mysqlLockWaitTimeout, mysqlDeadlock, mysqlLockNowait, mysqlQueryInterrupted:
		return Conflict, true
	case mysqlServerShutdown, mysqlConnectionKilled:
		return Connection, true
	case mysqlBadNull, mysqlDataTooLong, mysqlOutOfRange, mysqlTruncatedWrongValue, mysqlIncorrectValue,
		mysqlNoReferencedRow, mysqlRowIsReferenced, mysqlCheckViolated, mysqlCheckViolatedMaria:
		return Data, true
	}
	return Unknown, true
}
