// Package broker builds a watermill Publisher and Subscribers for a message broker named by a
// URL, so that the rest of onceflow, and its users, choose a broker with one string:
//
//	amqp://guest:guest@127.0.0.1:5672/                  RabbitMQ                     broker/amqp
//	postgres://postgres@127.0.0.1:5432/app              a queue in PostgreSQL        broker/sqlqueue, sqldb/postgres
//	mysql://root@127.0.0.1:3306/app                     a queue in MySQL or MariaDB  broker/sqlqueue, sqldb/mysql
//	sqlite://var/queue.db                               the embedded SQLite queue    broker/sqlitequeue, sqldb/sqlite
//	nats://127.0.0.1:4222                               NATS JetStream               broker/nats
//	redis://127.0.0.1:6379/0                            Redis Streams                broker/redis
//	kafka://127.0.0.1:9092/                             Apache Kafka                 broker/kafka
//	mem://tests                                         in-process, for tests only   broker/mem
//
// The package itself links no broker client. Each scheme is a package of its own, named in the
// last column, which registers the scheme when the program imports it (Register), as a
// database/sql driver does; a RabbitMQ consumer writes
//
//	import _ "github.com/onceflow/onceflow/broker/amqp"
//
// and links neither NATS nor Redis nor the SQLite queue. broker/all imports every scheme, for
// programs that take any URL. Open names the import that a URL's scheme needs when it is
// missing.
//
// Every scheme gives the same guarantees, which onceflow's exactly-once processing builds on:
//
//   - a message is stored by the broker (durable, where the broker is) when Publish returns nil;
//   - consumers of one consumer group compete: a message goes to one of them at a time, and
//     each Subscribe call is one such consumer; every consumer group gets every message;
//   - a subscription holds up to its prefetch of deliveries unsettled and hands them out
//     without waiting for their acks. Each message's context carries a redelivery.Info and
//     ends, with its cause (context.Cause), when the delivery does: at its ack or nack, or
//     unsettled, when the broker gives the message to another consumer (its ack timeout
//     passed, its connection was lost) or the subscription ends. An ack or nack given before
//     then counts, also when the subscription sees it after;
//   - a message is delivered until it is acknowledged: a nacked message is delivered again
//     after the delay of redelivery.NackAfter, or Options.NackDelay, and the message a
//     consumer held when it went away is delivered again to another consumer (at once where
//     the broker notices, after Options.AckTimeout where it cannot);
//   - delivery is at least once: a message acknowledged just before a crash may come again,
//     which onceflow's deduplication absorbs;
//   - the message's UUID, metadata and payload arrive as published. Messages from producers
//     that are not watermill arrive too, with their headers as string metadata and, for AMQP,
//     the message_id property in the header amqp_message_id, for the converter's id policy.
//
// What differs, scheme by scheme: whether Peek, Move and Delete work; what keeps a nacked
// message until its delay has passed (the broker, or the subscriber, which holds it in
// process); whose count of a message's deliveries the router reads (the broker's, or on a
// RabbitMQ classic queue the router's own, kept in the handler's database); and what applies
// the messages of one key in order (no broker hands them out in order once many deliveries
// are in flight; onceflow's QoS ExactlyOnceInOrder does, and on Kafka so does a handler with
// DedupByOffset, in the order of the partition):
//
//	scheme    Peek, Move, Delete  nack delay  delivery count                 a key's order
//	amqp      yes                 subscriber  quorum queue's, else router's  ExactlyOnceInOrder
//	postgres  yes                 database    lease's                        ExactlyOnceInOrder
//	mysql     yes                 database    lease's                        ExactlyOnceInOrder
//	sqlite    yes                 queue file  lease's                        ExactlyOnceInOrder
//	nats      yes                 JetStream   JetStream's                    ExactlyOnceInOrder
//	redis     yes                 Redis       pending entry's                ExactlyOnceInOrder
//	kafka     yes                 subscriber  commit metadata                partition's (DedupByOffset), ExactlyOnceInOrder
//	mem       no                  subscriber  in memory                      ExactlyOnceInOrder
//
// Broker.Peek, Move, Delete and Trim read and maintain the messages that wait on a topic,
// beside the Subscribers (the onceflow command's dlq list and dlq replay). Open lists the
// URL's query parameters; docs/brokers.md describes each scheme: its URL and parameters,
// topology, and what it does on nack and when a consumer dies.
package broker
