// Package amqp is onceflow's RabbitMQ scheme: the topology, the tolerant marshaler and the
// publisher (watermill-amqp's, configured here). Package broker opens it for amqp:// and
// amqps:// URLs; it does not import package broker.
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
package amqp
