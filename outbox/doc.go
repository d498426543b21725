// Package outbox is the transactional outbox: a processor publishes its outgoing messages into a
// table of the application database, in the transaction of its business writes, and a Relay
// moves them to the destination broker afterwards. No distributed (XA) transaction spans the
// database and the broker, yet a message is sent if and only if the business writes committed.
//
// # The exactly-once chain
//
//	incoming message
//	  -> Transaction middleware opens tx
//	       Deduplicate records the message id in tx
//	       processor writes the business rows in tx
//	       processor calls Outbox.Publish(ctx, topic, msgs...): outbox rows in tx
//	     COMMIT: all of it, or (rollback) none of it
//	  -> the incoming message is acknowledged, after the commit
//	Relay (any node, any time later):
//	     reads committed outbox rows in order -> publishes each to its topic -> records its offset
//	  -> the consumers of the destination run the same chain: their Deduplicate absorbs copies
//
// Each step is safe on its own. The processor's effects and its outgoing messages commit
// together, so a rollback sends nothing and a commit sends everything. The relay is
// at-least-once: it records a message as sent only after the destination publish returned nil,
// so a relay that dies between the two sends the message again, with the same UUID, and the
// next consumer's duplicate detection recognises the copy. At-least-once delivery plus
// deduplication by message id is exactly-once processing along the whole chain.
//
// # Use
//
//	ob, err := outbox.New(db, outbox.Config{}) // once per database
//	router.AddMigration(ob.Migrate)
//	router.AddHandler(onceflow.Handler{ ..., DB: db, QoS: onceflow.ExactlyOnce,
//		Processor: processor.Func(func(ctx context.Context, md *messagedata.MessageData) error {
//			tx, _ := processor.TxFromContext(ctx)
//			// ... business writes through tx ...
//			confirmed := message.NewMessage(outbox.DerivedID(md.ID, "confirmed"), body)
//			return ob.Publish(ctx, "orders.confirmed", confirmed) // last step
//		}),
//	})
//
//	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: brokerPublisher})
//	go relay.Run(ctx) // on one or more nodes
//
// # Message ids
//
// Publish keeps each message's UUID, and the relay sends it unchanged. Derive the outgoing ids
// from the incoming message (DerivedID(md.ID, "invoice")), never at random: should the incoming
// message be processed twice (a handler without duplicate detection, or an expired dedup key),
// the second run publishes the same ids, which downstream deduplication absorbs.
//
// # Storage
//
// The outbox is a watermill-sql topic in the application database, with one table of messages
// and one of consumer-group offsets, created by Outbox.Migrate (register it with
// router.AddMigration(ob.Migrate)):
//
//	PostgreSQL      <table>, <table>_offsets        watermill-sql DefaultPostgreSQLSchema and offsets adapter
//	MySQL, MariaDB  <table>, <table>_offsets,       watermill-sql DefaultMySQLSchema and offsets adapter,
//	                <table>_lock                    plus a one-row table that publishers lock in turn
//	SQLite          onceflow_queue_<table>,         the embedded queue's adapters (broker/sqlitequeue)
//	                onceflow_offsets_<table>
//
// Each row holds a watermill forwarder envelope: JSON with the destination topic, the message
// UUID, its payload (base64) and its metadata. The row's own uuid column is the envelope's,
// not the message's; on PostgreSQL, payload->>'uuid' is the message's. Publish never creates
// tables: on MySQL, DDL inside the handler's transaction would commit it.
//
// Offsets must become visible in increasing order, or the relay, having sent and recorded a
// later offset, would skip an earlier one that commits afterwards. Each dialect ensures it:
//
//   - PostgreSQL: each row records the id of the transaction that wrote it, and the relay reads
//     only transactions older than the oldest one still running, in (transaction id, offset)
//     order. A long-running writing transaction anywhere on the server therefore holds every
//     relay back until it ends (the lag gauge shows it).
//   - MySQL and MariaDB: AUTO_INCREMENT offsets are allocated at INSERT, so Publish locks a
//     shared row first and holds it until the transaction ends: publishing transactions take
//     turns from their Publish to their commit. Publish as the processor's last step; several
//     messages per transaction (group commit) raise the rate past one commit at a time. The
//     relay reads the committed rows at READ COMMITTED, so that it locks no gap that Publish
//     would wait for while it sends a batch.
//   - SQLite: one writer at a time. The relay reads without a transaction and writes its
//     offset in a short transaction of its own, so it never holds the database's write lock
//     while it publishes: a destination queue file whose consumers write the application
//     database cannot wait on it in a cycle.
//
// Keep transactions short.
//
// # Relays
//
// Run one or more relays per outbox, on any nodes (on SQLite, on the machine of the database
// file). Relays of one consumer group take turns (a lock on the group's offsets row on
// PostgreSQL and MySQL, a lock file on SQLite), so in normal operation each message is sent
// once, in order; the others wait. A relay resumes from
// its group's committed offset after a restart. A failed destination publish is retried every
// ResendInterval, and nothing after the message is sent meanwhile.
//
// Relay.Stats and Relay.RegisterMetrics report the backlog (committed messages not yet sent)
// and the lag (age of the oldest) as the gauges onceflow.outbox.backlog and
// onceflow.outbox.lag.
//
// # Growth
//
// The relay does not delete what it has sent: the messages table grows by every message
// published, until Outbox.Purge deletes, in bounded batches, the messages that every registered
// consumer group has sent. Run it periodically from one process.
package outbox
