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
//	Relays (any nodes, woken by the commit):
//	     claim committed outbox rows under leases -> publish each to its topic -> delete its lease
//	  -> the consumers of the destination run the same chain: their Deduplicate absorbs copies
//
// Each step is safe on its own. The processor's effects and its outgoing messages commit
// together, so a rollback sends nothing and a commit sends everything. The relay is
// at-least-once: it records a message as sent only after the destination publish returned nil,
// so a relay that dies between the two leaves the message to be sent again, with the same
// UUID, and the next consumer's duplicate detection recognises the copy. At-least-once delivery
// plus deduplication by message id is exactly-once processing along the whole chain.
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
//	go relay.Run(ctx) // on one or more nodes; Close it on shutdown
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
// The outbox keeps the tables of a watermill-sql topic in the application database, and
// beside them a table of leases, as onceflow's SQL queues keep a topic (broker/sqlqueue,
// broker/sqlitequeue); Outbox.Migrate creates them (register it with
// router.AddMigration(ob.Migrate)):
//
//	PostgreSQL      <table>, <table>_offsets, <table>_leases    watermill-sql DefaultPostgreSQLSchema and
//	                                                            offsets adapter; sqlqueue's leases
//	MySQL, MariaDB  <table>, <table>_offsets, <table>_leases,   watermill-sql DefaultMySQLSchema and offsets
//	                <table>_lock                                adapter; sqlqueue's leases; a one-row table
//	                                                            that publishers lock in turn
//	SQLite          onceflow_queue_<table>,                     the embedded queue's topic (broker/sqlitequeue)
//	                onceflow_offsets_<table>,
//	                onceflow_leases_<table>
//
// Each row holds an envelope in the format of watermill's forwarder: JSON with the destination
// topic, the message UUID, its payload (base64) and its metadata. The row's own uuid column is
// the envelope's, not the message's; on PostgreSQL, payload->>'uuid' is the message's. Publish
// never creates tables: on MySQL, DDL inside the handler's transaction would commit it.
//
// A consumer group's row in the offsets table is its cursor: every row at or below it has been
// sent by the group, dead-lettered, or is leased (being sent, or waiting to be sent again), and
// has a row in the leases table until it is sent. Rows must become visible in the order of the
// cursor, or a relay, having moved the cursor past a later row, would skip an earlier one that
// commits afterwards. Each dialect ensures it:
//
//   - PostgreSQL: each row records the id of the transaction that wrote it, and the relays
//     claim only rows of transactions older than the oldest one still running, in
//     (transaction id, offset) order. A long-running writing transaction anywhere on the server
//     therefore holds every relay back until it ends (the lag gauge shows it).
//   - MySQL and MariaDB: AUTO_INCREMENT offsets are allocated at INSERT, so Publish locks a
//     shared row first and holds it until the transaction ends: publishing transactions take
//     turns from their Publish to their commit. Publish as the processor's last step; several
//     messages per transaction (group commit) raise the rate past one commit at a time.
//   - SQLite: one writer at a time.
//
// The relays claim and settle in short transactions of their own and hold none while the
// destination takes a message, so a Publish never waits for the destination broker (on SQLite,
// the relays never hold the database's write lock while they publish). Keep transactions short.
//
// # Relays
//
// Run one or more relays per outbox, on any nodes. They share the work: each claims up to
// RelayConfig.BatchSize committed rows under a lease (RelayConfig.AckDeadline) and sends them
// one at a time; no two relays of a group hold a row at once while its lease runs, so in
// normal operation each message is sent once. A relay that dies leaves its rows to the others
// when their leases pass; Close gives them back at once. Relays of different consumer groups
// each send every message. A group that relays of earlier versions ran (taking turns on its
// offsets row) goes on where they stopped: its offset becomes the cursor. Earlier relays that
// still run beside the new ones lose nothing, but may send some messages twice.
//
// A relay claims new rows as soon as it hears of a Publish, and otherwise every
// RelayConfig.PollInterval. Publish runs before its transaction commits, so a relay that hears
// of one looks at once and again 1, 2, 4, ... ms later, until it has received a message or the
// poll interval has passed; each look is a cheap query that takes no lock. Outbox.Publish
// tells the relays of the same outbox in its own process directly. On PostgreSQL it also
// notifies the outbox's channel, on which every relay listens, wherever it runs: by default
// from a session of its own right after the Publish (at most one notification per 5 ms),
// because PostgreSQL serialises the commits of transactions that notify; with
// Config.NotifyInTransaction inside the transaction, which the database delivers at the
// commit. MySQL and SQLite tell no other session of a commit: relays in other processes find
// the rows at their next poll.
//
// Measured on loopback with the default poll interval (100 ms), from the commit to the
// destination's Publish, medians of 25 in three rounds beside the relay that only polled (on a
// machine shared with other work): 1 to 8 ms with the relay in the publishing process, on
// every dialect, and 2.5 to 5.4 ms on PostgreSQL from another process; the polling relay took
// 43 to 70 ms (TestRelay_IsWokenByEachCommitWithoutWaitingForItsPoll shows the wake-up, with a
// poll interval of an hour, and logs its latencies).
//
// # Failures
//
// A message whose publish fails is nacked and sent again after RelayConfig.ResendInterval,
// doubled at each further delivery up to MaxResendInterval; the messages behind it go on
// meanwhile. The delivery count is kept in the row's lease, so it survives relays that die.
//
//   - A message the destination refuses for good (too large, invalid) is given up to the
//     dead-letter topic (RelayConfig.DeadLetterPublisher and DeadLetterTopic, by default the
//     destination and onceflow_dead_letter), with the reason and the headers of
//     middleware.PublishDeadLetter, which drops the payload if that is what the dead-letter
//     broker refuses too. It is given up at once when RelayConfig.Refused recognises the
//     error, and otherwise at its MaxAttempts-th delivery, provided the destination accepted
//     another message after this relay first saw it fail: the destination works, this message
//     does not go through. A message refused while nothing else is sent is retried, every
//     MaxResendInterval at most, until either happens.
//   - A destination that is down fails every message. After the publishes of two different
//     messages have failed in a row, the relay holds the message it has and publishes it again
//     in place, after growing pauses, taking no other, until the destination accepts it; these
//     failures give no message up. Only the first message that failed, before the relay could
//     tell, is sent after the ones behind it (and the held one, when the outage outlasts its
//     lease: the relay then gives it back and holds the next).
//
// # Order
//
// A single relay sends the rows in the order they became visible, except the messages it had
// to send again, which come after the ones behind them; several relays send in parallel, in no
// particular order. Exactly-once does not depend on it: copies are absorbed by message id.
// Nor does per-key ordering: ExactlyOnceInOrder (package ordering) numbers the messages of a
// key in the producing transaction (ordering.Sequencer) and its consumers apply them in the
// order of those numbers, parking the early ones, whatever order they arrive in. A sequenced
// message that a relay gives up to the dead-letter topic leaves a gap that its key waits at
// (ordering's GapTimeout and GapPolicy); replaying the dead letter fills it.
//
// Relay.Stats and Relay.RegisterMetrics report the backlog (committed messages not yet sent,
// leased ones included) and the lag (age of the oldest) as the gauges onceflow.outbox.backlog
// and onceflow.outbox.lag.
//
// # Growth
//
// Every RelayConfig.PurgeInterval (a minute by default), one relay of the outbox at a time (an
// advisory lock on PostgreSQL, a named lock on MySQL, a lock file beside the database on
// SQLite, each tried without waiting) runs Outbox.Purge: it deletes, in bounded batches, the
// messages that every registered consumer group has sent or given up, keeping the last row a
// cursor passed. A consumer group that no relay runs any more holds every message back: delete
// its row from the offsets table. Outbox.Purge can also be run by hand.
package outbox
