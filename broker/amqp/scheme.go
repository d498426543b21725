package amqp

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
)

func init() { broker.Register("amqp", openScheme) }

// openScheme publishes with watermill-amqp's publisher and consumes with this package's Subscriber,
// both over Topology: a fanout exchange per topic and a queue per consumer group, declared with
// the queue parameters of the URL (queue_type, delivery_limit, dead_letter_exchange), which
// are not passed on to the driver.
func openScheme(_ context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	dsn, queue, err := ParseQueueParams(t.URL)
	if err != nil {
		return nil, err
	}
	topology := Topology{ConsumerGroup: o.ConsumerGroup, Queue: queue}
	cfg := Config{
		URL:       dsn,
		Topology:  topology,
		Prefetch:  o.Prefetch,
		NackDelay: max(o.NackDelay, 0),
		Logger:    o.Logger,
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pub, err := NewPublisher(dsn, topology, o.Logger)
	if err != nil {
		return nil, err
	}
	return &broker.Backend{
		Publisher:  pub,
		CheckTopic: topology.CheckTopic,
		NewSubscriber: func() (message.Subscriber, error) {
			return NewSubscriber(cfg)
		},
		View: newView(dsn, o.ConsumerGroup),
	}, nil
}
