// Package all registers every scheme of broker.Open, and the database drivers that the SQL
// queues open, for programs that take any broker URL (the onceflow command, tools, tests):
//
//	import _ "github.com/onceflow/onceflow/broker/all"
//
// It links every broker's client and the three SQL drivers. A program that opens one kind of
// broker imports that scheme's package instead (broker/amqp, broker/nats, ...).
package all

import (
	_ "github.com/onceflow/onceflow/broker/amqp"        // amqp://, amqps://
	_ "github.com/onceflow/onceflow/broker/kafka"       // kafka://
	_ "github.com/onceflow/onceflow/broker/mem"         // mem://
	_ "github.com/onceflow/onceflow/broker/nats"        // nats://
	_ "github.com/onceflow/onceflow/broker/redis"       // redis://, rediss://
	_ "github.com/onceflow/onceflow/broker/sqlitequeue" // sqlite://, sqlite3://
	_ "github.com/onceflow/onceflow/broker/sqlqueue"    // postgres://, postgresql://, mysql://, mariadb://
	_ "github.com/onceflow/onceflow/sqldb/mysql"        // the mysql:// queue's database
	_ "github.com/onceflow/onceflow/sqldb/postgres"     // the postgres:// queue's database
	_ "github.com/onceflow/onceflow/sqldb/sqlite"       // the sqlite:// queue's file
)
