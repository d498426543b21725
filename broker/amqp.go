package broker

import (
	"github.com/ThreeDotsLabs/watermill/message"

	rabbitmq "github.com/onceflow/onceflow/broker/amqp"
)

// HeaderAMQPRedelivered is set to "true" on a message that RabbitMQ delivered with its
// redelivered flag: it was delivered before, to this or another consumer, and not acked. It is
// rabbitmq.HeaderRedelivered of package broker/amqp.
const HeaderAMQPRedelivered = rabbitmq.HeaderRedelivered

// AMQPMarshaler converts between watermill messages and AMQP messages, tolerantly: its
// Unmarshal never fails. It is the Marshaler of package broker/amqp, which documents it.
type AMQPMarshaler = rabbitmq.Marshaler

// amqpQueueName names the durable queue of a consumer group on a topic.
func amqpQueueName(topic, group string) string {
	return rabbitmq.Topology{ConsumerGroup: group}.QueueName(topic)
}

// openAMQP publishes with watermill-amqp's publisher and consumes with broker/amqp's
// Subscriber, both over the topology of broker/amqp: a fanout exchange per topic and a queue
// per consumer group, declared with the queue parameters of the URL (queue_type,
// delivery_limit, dead_letter_exchange), which are not passed on to the driver.
func openAMQP(t *target, o Options) (*backend, error) {
	dsn, queue, err := rabbitmq.ParseQueueParams(t.dsn)
	if err != nil {
		return nil, err
	}
	topology := rabbitmq.Topology{ConsumerGroup: o.ConsumerGroup, Queue: queue}
	cfg := rabbitmq.Config{
		URL:       dsn,
		Topology:  topology,
		Prefetch:  o.Prefetch,
		NackDelay: o.nackDelay(),
		Logger:    o.Logger,
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pub, err := rabbitmq.NewPublisher(dsn, topology, o.Logger)
	if err != nil {
		return nil, err
	}
	return &backend{
		pub:        pub,
		checkTopic: topology.CheckTopic,
		newSubscriber: func() (message.Subscriber, error) {
			return rabbitmq.NewSubscriber(cfg)
		},
		// The subscriber keeps Prefetch deliveries in flight per subscription, holds nacked
		// ones for their delay, and gives back what a closing consumer holds.
		native: true,
		view:   newAMQPView(dsn, o.ConsumerGroup),
	}, nil
}
