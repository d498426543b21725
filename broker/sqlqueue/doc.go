// Package sqlqueue is the message queue that onceflow keeps in PostgreSQL or MySQL/MariaDB (the
// postgres:// and mysql:// brokers): a watermill Subscriber that keeps many deliveries in
// flight, with leases, delivery counts and delayed redelivery, over the tables of
// watermill-sql v3, whose Publisher writes the messages.
//
// It registers the postgres://, postgresql://, mysql:// and mariadb:// schemes of broker.Open.
// The queue opens its database with sqldb.Open, whose drivers are packages of their own: a
// program that uses a PostgreSQL queue imports
//
//	import (
//		_ "github.com/onceflow/onceflow/broker/sqlqueue"
//		_ "github.com/onceflow/onceflow/sqldb/postgres"
//	)
//
// and sqldb/mysql for a MySQL or MariaDB queue.
//
// # Tables
//
// Each topic keeps watermill-sql's tables, unchanged, so that producers and stored messages
// stay valid: the messages table "watermill_<topic>", where every message has an increasing
// offset, and the offsets table "watermill_offsets_<topic>" with one row per consumer group.
// Beside them, "onceflow_leases_<topic>" has one row per message that a group has handed out
// and not yet acknowledged: (consumer_group, offset, deliveries, visible_at), and on
// PostgreSQL the message's transaction id. Topics are at most MaxTopic bytes, so that every
// name fits the identifier limits. Config.Tables names the tables otherwise, for tables of the
// same layout that belong to something else (onceflow's transactional outbox).
//
// A group's row in the offsets table is its cursor: every message at or below it has been
// acknowledged or is leased. A database written by watermill-sql's own subscriber is read as it
// is: its acknowledged offset is a cursor with no leases.
//
// # Delivery
//
// Each Subscribe call is one consumer of the topic in the Queue's consumer group. It claims
// messages in short transactions, never holding one while handlers run, and hands them out
// without waiting for their acknowledgements, up to Config.Prefetch unsettled at a time:
//
//   - first due leases (nacked messages whose delay has passed, leases that expired), oldest
//     first: their deliveries count goes up by one and their lease runs for Config.AckTimeout;
//   - then new messages after the cursor, in the order they became safe to read (see below):
//     each gets a lease with deliveries = 1, and the cursor moves past them.
//
// Claims lock with FOR UPDATE SKIP LOCKED: consumers of one group never wait for each other,
// and never hold the same message at once while its lease runs. Every message's context
// carries a redelivery.Info whose Count is the deliveries count of its lease: it is in the
// database, so it survives a consumer that dies, and a message that kills its consumer every
// time reaches the router's delivery limit.
//
//   - Ack deletes the lease. The acknowledgements given within a few milliseconds of each
//     other are written in one statement; an acknowledgement is durable when it commits.
//   - Nack makes the lease visible again after redelivery.RequestedDelay, or Config.NackDelay
//     when the router asked for none. The messages behind it keep flowing; the nacked one comes
//     back, to any consumer of the group, with its count one higher.
//   - A delivery not settled within its lease has its context cancelled, and the message is
//     claimed again. That is also what happens to the deliveries of a consumer that died,
//     SIGKILL included: they come back after AckTimeout.
//   - Close writes the acknowledgements and nacks given before it, and gives back the
//     unsettled leases at once.
//
// An idle subscription looks for new messages every Config.PollInterval; Queue.Wake makes it
// look at once, for a caller that learns of a commit sooner (a PostgreSQL notification).
//
// Delivery is at least once: a message whose acknowledgement was not written before its lease
// passed, or before its consumer died, comes again, and onceflow's deduplication absorbs it.
// Messages are handed out in offset order but settle in any order, so a redelivered message
// can come after later ones.
//
// # Visibility order
//
// Offsets are taken before commit, so a transaction can commit a lower offset after another
// committed a higher one; the cursor must never pass a message that commits later. On
// PostgreSQL a claim reads only rows of transactions older than the oldest one running on the
// server, in (transaction_id, offset) order, as watermill-sql does: a transaction that stays
// open anywhere on the server holds new messages back until it ends. On MySQL and MariaDB a
// claim reads with a locking read, which waits for a lower offset whose transaction is still
// open.
//
// # Inspection
//
// Queue.Waiting lists the messages that wait for the group, leased ones first, then those
// after the cursor, and Queue.Remove deletes one with its leases (onceflow dlq list and
// replay).
package sqlqueue
