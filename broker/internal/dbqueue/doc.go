// Package dbqueue is what the PostgreSQL and MySQL queue (broker/sqlqueue) and the SQLite queue
// (broker/sqlitequeue) share: wake-ups and polls, transactions, reading rows and counts, the
// dead-letter keys, and the shell of their inspection (View, Trim). Their tables, claims and
// leases stay each their own.
package dbqueue
