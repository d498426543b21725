package amqp

import (
	"log/slog"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/wmlog"
)

// publishChannels is the number of AMQP channels the publisher keeps open: concurrent Publish
// calls up to that number proceed in parallel, each waiting for its confirms.
const publishChannels = 8

var _ wamqp.Marshaler = Marshaler{}

// NewPublisher returns a publisher for the RabbitMQ server at url (without the queue
// parameters, see ParseQueueParams), publishing with Marshaler to the exchange named after
// each topic, declared with topology before its first message. A message is stored by
// RabbitMQ when Publish returns nil (publisher confirms). The publisher reconnects by itself.
func NewPublisher(url string, topology Topology, logger *slog.Logger) (message.Publisher, error) {
	if err := topology.Validate(); err != nil {
		return nil, err
	}
	cfg := wamqp.Config{
		Connection: wamqp.ConnectionConfig{AmqpURI: url, Reconnect: wamqp.DefaultReconnectConfig()},
		Marshaler:  Marshaler{},
		Exchange: wamqp.ExchangeConfig{
			GenerateName: func(topic string) string { return topic },
			Type:         "fanout",
			Durable:      true,
		},
		Queue: wamqp.QueueConfig{
			GenerateName: topology.QueueName,
			Durable:      true,
		},
		QueueBind: wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "" }},
		Publish: wamqp.PublishConfig{
			GenerateRoutingKey: func(string) string { return "" },
			ConfirmDelivery:    true,
			ChannelPoolSize:    publishChannels,
		},
		TopologyBuilder: topology,
	}
	pub, err := wamqp.NewPublisher(cfg, wmlog.Adapter(logger))
	if err != nil {
		return nil, err
	}
	return pub, nil
}
