// Package amqp is onceflow's RabbitMQ scheme: the topology, the tolerant marshaler, the
// publisher (watermill-amqp's, configured here) and a Subscriber of its own, built on
// amqp091-go, that keeps many deliveries in flight. It registers the amqp:// and amqps://
// schemes of broker.Open, which a program links by importing it:
//
//	import _ "github.com/onceflow/onceflow/broker/amqp"
//
// # Topology
//
// Each topic is a durable fanout exchange named after it; each consumer group has a durable
// queue "<topic>.<group>" bound to it. Publisher and Subscriber declare both the same way
// (Topology), so a message published before the group's first subscription waits in the
// group's queue. The queue arguments come from Queue, or from the URL parameters queue_type
// (classic or quorum), delivery_limit (x-delivery-limit, quorum queues only) and
// dead_letter_exchange (x-dead-letter-exchange); ParseQueueParams takes them out of the URL
// before it reaches amqp091-go. RabbitMQ refuses to redeclare a queue with other arguments
// (PRECONDITION_FAILED), so every process of a group must use the same ones.
//
// A broker-side delivery limit is a backstop: onceflow's router enforces its own limit and
// dead-letters with a reason, so delivery_limit must be above the router's limit, or RabbitMQ
// drops (or dead-letters without a reason) a failing message before the router can.
//
// # Delivery
//
// Each Subscribe call is one consumer of the group's queue, on a channel of its own with
// basic.qos Prefetch; consumers of a group compete, each message going to one at a time. The
// deliveries are handed out as they arrive, up to Prefetch unsettled, without waiting for
// acks (the subscriber is a source of onceflow's in-flight engine, which keeps that window).
// Each message's context carries a redelivery.Info:
//
//   - on a quorum queue, Count is the delivery count: 1 on a first delivery, and
//     x-delivery-count+1 after, as RabbitMQ counts every return of the message (a nack, a
//     consumer whose channel or connection closed, a consumer process killed), durably;
//   - on a classic queue, Count is 0 and Redelivered is RabbitMQ's redelivered flag;
//   - DelaysNacks is true.
//
// An ack settles the delivery by its tag. Acks are coalesced, because a basic.ack sent alone
// costs RabbitMQ about as much CPU as the delivery it settles: a run of acked tags from the
// oldest unsettled delivery goes as one basic.ack with multiple set, within Config.AckDelay,
// or at once when it holds half the prefetch window, or when the consumer says that it has
// settled a batch together (redelivery.Flush: onceflow's router does after the acks of a group
// that committed in one transaction). An ack behind an older delivery that is
// still being processed (deliveries processed concurrently finish in any order) waits for it
// to join the run: for twice the mean time from hand-out to ack, at most
// Config.OutOfOrderAckDelay; then it goes alone, so that a stuck or held delivery keeps no
// ack waiting for longer. None waits when no other delivery is being processed.
//
// RabbitMQ cannot delay a redelivery, so a nacked message is held for the delay the router
// asked for (redelivery.NackAfter), or Config.NackDelay, and then given back with
// basic.nack(requeue); it keeps its prefetch slot meanwhile, and the messages behind it go on.
//
// When the connection or the channel is lost, the subscription reopens it with exponential
// backoff and goes on; the deliveries in flight get their contexts cancelled
// (ErrConnectionLost), their acks are dropped (tags belong to their channel), and RabbitMQ
// delivers them again. A consumer process
// that dies leaves its unsettled deliveries to the others as soon as RabbitMQ notices the
// connection close.
//
// Close ends the deliveries' contexts (ErrClosed), stops the consumers, sends the acks given
// before it, gives held messages back at once, and closes the channels (which gives back what was not settled) and the connection, within a
// bounded time even when RabbitMQ does not answer. Deliveries that RabbitMQ had sent ahead and
// that were never handed out are given back too; a quorum queue counts those returns as well.
package amqp
