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
// A subscription delivers as package broker says of every scheme, with up to Config.Prefetch
// deliveries unsettled. It claims in short transactions, never holding one while handlers run:
// first due leases (nacked messages whose delay has passed, leases that expired), oldest first,
// their deliveries count one higher; then new messages after the cursor, in the order they
// became safe to read (see below), each leased with deliveries = 1 as the cursor moves past
// it. Claims lock with FOR UPDATE SKIP LOCKED: consumers of one group never wait for each
// other. The deliveries count is each message's redelivery.Info.Count; it is in the database, so a
// message that kills its consumer every time reaches the router's delivery limit.
//
// An ack deletes the lease (the acks of a few milliseconds go in one statement); a nack makes
// it due after its delay (Config.NackDelay), and so does a lease that passes unsettled, a dead
// consumer's included. An idle subscription looks for new messages every Config.PollInterval,
// or at once after Queue.Wake.
//
// # Visibility order
//
// Offsets are taken before commit, so a transaction can commit a lower offset after another
// committed a higher one; the cursor must never pass a message that commits later. On
// PostgreSQL a claim reads only rows of transactions older than the oldest one running on the
// server, in (transaction_id, offset) order: a transaction that stays open anywhere on the
// server holds new messages back until it ends. On MySQL and MariaDB a claim reads with a
// locking read, which waits for a lower offset whose transaction is still open.
package sqlqueue
