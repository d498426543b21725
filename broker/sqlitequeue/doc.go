// Package sqlitequeue is onceflow's embedded broker: a durable message queue in one SQLite file,
// offered as a watermill Publisher and Subscriber, that needs no server.
//
// It is built on watermill-sql v3 with an SQLite SchemaAdapter and OffsetsAdapter. Each topic
// has a messages table, "onceflow_queue_<topic>", where every message gets an increasing
// offset, and an offsets table, "onceflow_offsets_<topic>", with the last offset each consumer
// group acknowledged. Messages are not deleted when they are consumed: Trim removes those every
// known consumer group has acknowledged. The file is opened through sqldb.Open: WAL journal,
// synchronous=FULL, a 30 s busy timeout and BEGIN IMMEDIATE transactions. Keep the queue in a
// file of its own, apart from the application database, as a broker is apart from a database.
//
// # Delivery
//
// Every consumer group receives every message of a topic, in offset order. A subscription reads
// a batch (Config.BatchSize messages) in one transaction and hands the messages out one at a
// time, each after the previous one is acknowledged. The transaction holds the file's write lock
// from the read until the batch ends: after its last message is acknowledged, when the
// subscriber closes, or when a message's ack deadline passes. So:
//
//   - consumers of one group, in one process or several, never receive the same message at
//     the same time;
//   - acknowledgements become durable when the batch's transaction commits;
//   - a consumer that dies (even by SIGKILL) or is cancelled before that leaves the whole batch
//     to the next consumer of the group: nothing is lost, and messages it had acknowledged in
//     that batch are delivered again. Delivery is at-least-once; onceflow's deduplication makes
//     the processing exactly-once;
//   - a nacked message is delivered again, before the next one, after Config.ResendInterval;
//   - a message neither acked nor nacked within Config.AckDeadline is delivered again.
//
// # Publishing from a handler
//
// Because a subscription holds the write lock while its handler runs, a handler that publishes
// to the same queue file (a dead letter, a follow-up message) must give the published message
// the delivered message's context:
//
//	out := message.NewMessage(watermill.NewUUID(), payload)
//	out.SetContext(in.Context())
//	err := publisher.Publish("next-topic", out)
//
// Such a message is written in the delivery's transaction: it becomes visible exactly when the
// acknowledgement of the delivered message commits, and it is undone if the delivery is nacked,
// passes its ack deadline, or its consumer dies. This works through any Queue over the same
// file in the process. A publish with any other context waits for the lock that its own
// subscription holds, and times out. Messages that a watermill router handler returns are
// published with a fresh context, so they are not covered: publish them from the handler.
//
// # Concurrency
//
// The file has one writer at a time, and a subscription is a writer for as long as its batch
// lasts: all consumers of a file, of every topic and group, take turns, and so do publishers.
// More consumers add availability, not throughput. Within a process, writers get their turns in
// the order they asked for them, so a publisher waits at most about one batch even while a
// consumer works through a backlog. Between processes SQLite's lock decides with no such order;
// a consumer pauses briefly after each batch so that writers of other processes get in. Keep
// handlers short, and read and acknowledge delivered messages promptly: a subscription whose
// messages are not read keeps the turn until the ack deadline.
//
// Reading (Topics, Len, Backlog, List) never waits for writers.
package sqlitequeue
