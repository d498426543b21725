// Package dbqueue is what the two queues in a database share, the PostgreSQL and MySQL queue
// (broker/sqlqueue) and the SQLite queue file (broker/sqlitequeue): the wake-ups of idle
// subscriptions when messages are published and their poll between claims, their
// transactions, the reading of a query's rows and of a statement's count, the dead-letter keys
// that store a dead letter once, and the shell of their inspection (the broker.View over it,
// Trim's bounded deletes). Their tables, claims and leases stay each their own.
package dbqueue
