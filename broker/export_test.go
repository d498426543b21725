package broker

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
)

// Internals that the tests of package broker_test use.
var (
	NATSStreamName = natsbroker.StreamName
	AMQPQueueName  = amqpQueueName
)

// NATSUnmarshal is the NATS adapter's Unmarshal.
func NATSUnmarshal(m *nats.Msg) (*message.Message, error) { return natsMarshaler{}.Unmarshal(m) }

// RedisUnmarshal is the Redis adapter's Unmarshal.
func RedisUnmarshal(values map[string]any) (*message.Message, error) {
	return redisMarshaller{}.Unmarshal(values)
}
