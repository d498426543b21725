package broker

import "time"

// Headers that a scheme's package sets or reads, here so that code handling messages of any
// broker can name them without linking the scheme.
const (
	// HeaderAMQPRedelivered is set to "true" on a message that RabbitMQ delivered with its
	// redelivered flag: it was delivered before, to this or another consumer, and not acked.
	HeaderAMQPRedelivered = "amqp_redelivered"

	// HeaderNATSMsgID, set on a message published to a NATS broker, is the Nats-Msg-Id the
	// message is published with, in place of its UUID. JetStream drops a publish whose
	// Nats-Msg-Id the stream has seen within its duplicate window (2 minutes by default): a
	// message that must be published again with the same UUID within that window, such as a
	// dead letter moved back to the topic it came from, needs an id of its own. Broker.Move
	// sets it. The header itself is not sent; other schemes ignore it.
	HeaderNATSMsgID = "onceflow_nats_msg_id"

	// HeaderRedisMetadata carries the raw "metadata" field of a Redis stream entry that did not
	// decode as watermill metadata (an entry written by another producer).
	HeaderRedisMetadata = "redis_metadata"
)

// DeadLetterKeyWindow is how long the brokers that store a dead letter once per key
// (messagedata.HeaderDeadLetterKey: the SQLite, PostgreSQL and MySQL queues) remember a key: a
// dead letter published again within it (by the consumer after one that died before recording
// it, at the message's next delivery) is left out; one published later (a message sent again
// by its producer an hour after) is stored. NATS has its stream's duplicate window instead.
const DeadLetterKeyWindow = time.Hour
