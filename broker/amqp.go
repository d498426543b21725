package broker

import (
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
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

// openAMQP publishes with watermill-amqp's publisher and consumes with its subscriber, both
// over the topology of broker/amqp: a fanout exchange per topic and a queue per consumer group,
// declared with the queue parameters of the URL (queue_type, delivery_limit,
// dead_letter_exchange), which are not passed on to the driver.
func openAMQP(t *target, o Options) (*backend, error) {
	dsn, queue, err := rabbitmq.ParseQueueParams(t.dsn)
	if err != nil {
		return nil, err
	}
	topology := rabbitmq.Topology{ConsumerGroup: o.ConsumerGroup, Queue: queue}
	prefetch := o.Prefetch
	if prefetch == 0 {
		prefetch = DefaultPrefetch
	}
	pub, err := rabbitmq.NewPublisher(dsn, topology, o.Logger)
	if err != nil {
		return nil, err
	}
	subCfg := wamqp.Config{
		Connection: wamqp.ConnectionConfig{AmqpURI: dsn, Reconnect: wamqp.DefaultReconnectConfig()},
		Marshaler:  AMQPMarshaler{},
		Exchange: wamqp.ExchangeConfig{
			GenerateName: func(topic string) string { return topic },
			Type:         "fanout",
			Durable:      true,
		},
		Queue:           wamqp.QueueConfig{GenerateName: topology.QueueName, Durable: true},
		QueueBind:       wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "" }},
		Consume:         wamqp.ConsumeConfig{Qos: wamqp.QosConfig{PrefetchCount: prefetch}},
		TopologyBuilder: topology,
	}
	return &backend{
		pub:        pub,
		checkTopic: topology.CheckTopic,
		newSubscriber: func() (message.Subscriber, error) {
			return wamqp.NewSubscriber(subCfg, o.Logger)
		},
		// watermill-amqp nacks with requeue: RabbitMQ redelivers at once.
		relayNackDelay: o.nackDelay(),
		nackOnClose:    true,
		view:           newAMQPView(dsn, o.ConsumerGroup),
	}, nil
}
