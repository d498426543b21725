// Package sqlitequeue is onceflow's embedded broker: a durable message queue in one SQLite file,
// offered as a watermill Publisher and Subscriber, that needs no server. It registers the
// sqlite:// and sqlite3:// schemes of broker.Open when a program imports it; the program imports
// the SQLite driver beside it, as it would for its database:
//
//	import (
//		_ "github.com/onceflow/onceflow/broker/sqlitequeue"
//		_ "github.com/onceflow/onceflow/sqldb/sqlite"
//	)
//
// The package links no driver itself, so that the outbox, which reads its SQLite tables with
// this package's code, adds no SQLite driver to a program on PostgreSQL or MySQL.
//
// Each topic has four tables: the messages table "onceflow_queue_<topic>", an increasing
// offset per message; the offsets table "onceflow_offsets_<topic>", a cursor per consumer
// group, at or below which the group has claimed every message; the claims table
// "onceflow_claims_<topic>", a row per run of up to 63 new messages a group claimed in one go;
// and the leases table "onceflow_leases_<topic>", a row per message a group holds outside a
// claim (nacked, given back, or claimed again). Messages are not deleted when they are
// consumed: Trim removes those every known consumer group has acknowledged. The file is opened
// through sqldb.Open: WAL journal, synchronous=FULL, a 30 s busy timeout and BEGIN IMMEDIATE
// transactions. The subscriptions' claims and settlements commit with synchronous=NORMAL, on a
// connection of their own: such a commit survives the death of the process, and only a power
// loss or a crash of the operating system can take one back, which makes messages come again
// (never lost: publishes commit with FULL, and the WAL is synced in order). Keep the queue in
// a file of its own, apart from the application database, as a broker is apart from a
// database.
//
// A dead letter (a message with the header messagedata.HeaderDeadLetterKey) is stored once
// per topic and key within broker.DeadLetterKeyWindow: the publish records the key in
// DeadLetterKeysTable in its own transaction and leaves out a dead letter whose key is there.
//
// # Delivery
//
// A subscription delivers as package broker says of every scheme, with up to Config.BatchSize
// messages in flight. It claims in one short transaction: the group's leases that are due, then
// the messages after the group's cursor in offset order, leased for Config.AckDeadline by a
// claim row per 63 offsets, not a row per message. Every transaction of the file has its cost,
// so the settlements that the subscriptions of a topic in one Queue give within 10 ms go in one
// transaction, the next claim of any of them or a commit of their own (at once when the
// subscription has nothing else in flight). No transaction, and no lock of the file, is held
// while messages are processed.
//
// A nack makes its message due after its delay (Config.ResendInterval by default), and a lease
// that passes, a dead consumer's included, at once: it comes after the messages behind it, its
// count (redelivery.Info.Count) one higher. The count is in the leases table, so a message that
// kills its consumer every time reaches the router's delivery limit.
//
// # Concurrency
//
// The file has one writer at a time, but every write is short: a publish, a claim, a commit
// of settlements. Within a process, writers take their turns in arrival order; between
// processes SQLite's lock decides. Publishers, in this process or another, never wait for a
// consumer's handlers. Reading (Topics, Len, Backlog, List, Waiting) never waits for writers.
//
// # Files of earlier versions
//
// A file written before the queue had leases is consumed as it is: a group's acknowledged
// offset becomes its cursor, and the leases table is created at the first subscription; so is
// the claims table in a file written before the queue had claims, whose lease rows are
// consumed as they are. Stop every process of the file that runs the earlier version before
// consumers of the new one start: the earlier subscriber knows nothing of leases.
package sqlitequeue
