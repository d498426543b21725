// Package amqp is onceflow's RabbitMQ scheme: the topology, the tolerant marshaler, the
// publisher (watermill-amqp's, configured here) and a Subscriber of its own, built on
// amqp091-go, that keeps many deliveries in flight. It registers the amqp:// and amqps://
// schemes of broker.Open, which a program links by importing it:
//
//	import _ "github.com/onceflow/onceflow/broker/amqp"
//
// # Topology
//
// Publisher and Subscriber declare the same Topology: a fanout exchange per topic, and a queue
// per consumer group bound to it, with the queue arguments (Queue) of the URL parameters
// queue_type, delivery_limit and dead_letter_exchange (ParseQueueParams); every process of a
// group must use the same ones.
//
// # Delivery
//
// Each Subscribe call is one consumer of the group's queue, on a channel of its own with
// basic.qos Config.Prefetch. Each message's context carries a redelivery.Info:
//
//   - on a quorum queue, Count is the delivery count: 1 on a first delivery, and
//     x-delivery-count+1 after, as RabbitMQ counts every return of the message (a nack, a
//     consumer whose channel or connection closed, a consumer process killed), durably;
//   - on a classic queue, Count is 0 and Redelivered is RabbitMQ's redelivered flag.
//
// Acks are coalesced into basic.acks with multiple set (Config.AckDelay), because a basic.ack
// sent alone costs RabbitMQ about as much CPU as the delivery it settles. RabbitMQ cannot delay
// a redelivery: a nacked message is held for its delay (Config.NackDelay) and then given back
// with basic.nack(requeue), while the messages behind it go on.
//
// When the connection or the channel is lost, the subscription reopens it
// (Config.ReconnectInitial) and goes on; its deliveries in flight end (ErrConnectionLost), and
// RabbitMQ delivers them again. A consumer process that dies leaves its unsettled deliveries to
// the others as soon as RabbitMQ notices the connection close. Close gives back what the
// subscriptions hold (Subscriber.Close), and what RabbitMQ had sent ahead (a quorum queue
// counts those returns too), within a bounded time even when RabbitMQ does not answer.
package amqp
