// Package dbqueue is what the two queues in a database share, the PostgreSQL and MySQL queue
// (broker/sqlqueue) and the SQLite queue file (broker/sqlitequeue): the wake-ups of idle
// subscriptions when messages are published, their poll between claims, and the dead-letter
// keys that store a dead letter once. Their tables, claims and leases stay each their own.
package dbqueue
