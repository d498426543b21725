package amqp

import (
	"cmp"
	"errors"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Defaults of Config: each is the value of the field of its name when that field is zero.
const (
	DefaultPrefetch           = 10
	DefaultAckDelay           = 2 * time.Millisecond
	DefaultOutOfOrderAckDelay = 250 * time.Millisecond
	DefaultReconnectInitial   = 100 * time.Millisecond
	DefaultReconnectMax       = 5 * time.Second
	DefaultCloseTimeout       = 2 * time.Second
)

// maxPrefetch is the largest prefetch count AMQP can carry (a short integer).
const maxPrefetch = 1<<16 - 1

// Config configures a Subscriber. Fields left zero take their defaults; URL and
// Topology.ConsumerGroup are required.
type Config struct {
	// URL is the RabbitMQ server's URL, amqp://user:password@host:5672/vhost or amqps://...,
	// as amqp091-go's Dial takes it (without onceflow's parameters: see ParseQueueParams).
	URL string

	// Topology names the queue of each topic and declares it; it must be the publishers'.
	Topology Topology

	// Prefetch is the channel prefetch (basic.qos) of each subscription: how many deliveries
	// RabbitMQ hands it before their acks, all handed out at once. At most 65535. Defaults to
	// DefaultPrefetch, or to the window the consumer asks for when it subscribes
	// (redelivery.WithWindow) when that is larger.
	Prefetch int

	// NackDelay is how long a nacked message is held before it is given back to RabbitMQ, when
	// the router did not ask for a delay of its own (redelivery.NackAfter). Zero gives it back
	// at once. A held message keeps its prefetch slot.
	NackDelay time.Duration

	// AckDelay bounds how long an ack waits to be sent together with others when it can go
	// now: a run of acks contiguous from the oldest unsettled delivery goes as one basic.ack
	// with multiple set, within AckDelay of its oldest ack, or at once when it holds half the
	// window or at a redelivery.Flush. Defaults to DefaultAckDelay.
	AckDelay time.Duration

	// OutOfOrderAckDelay bounds how long an ack behind an older delivery still being
	// processed, or held after a nack, waits for it, to go with it in one multiple ack: twice
	// the mean time from hand-out to ack, between AckDelay and OutOfOrderAckDelay, or until no
	// delivery is being processed. At least AckDelay. Defaults to DefaultOutOfOrderAckDelay.
	OutOfOrderAckDelay time.Duration

	// ReconnectInitial is the wait before the first attempt to reopen a lost channel or
	// connection; it doubles (with jitter) after each failed attempt, up to ReconnectMax.
	// Defaults to DefaultReconnectInitial and DefaultReconnectMax.
	ReconnectInitial, ReconnectMax time.Duration

	// CloseTimeout bounds how long Close waits for RabbitMQ to take the acks and close the
	// channels and the connection; after it, Close drops the connection, and RabbitMQ requeues
	// what was unacked when it notices. Defaults to DefaultCloseTimeout.
	CloseTimeout time.Duration

	// Logger receives the logs of the subscriber (lost connections, reconnections). Defaults
	// to no logging.
	Logger *slog.Logger

	log watermill.LoggerAdapter // Logger for the watermill adapters, made by the defaults
}

// rules are the defaults and bounds of the settings every subscriber has.
var rules = inflight.Rules{
	Scheme:       "broker/amqp",
	Prefetch:     DefaultPrefetch,
	MaxPrefetch:  maxPrefetch,
	CloseTimeout: DefaultCloseTimeout,
}

func (c *Config) fields() inflight.Fields {
	return inflight.Fields{Prefetch: &c.Prefetch, NackDelay: &c.NackDelay, CloseTimeout: &c.CloseTimeout, Logger: &c.Logger, Log: &c.log}
}

// Validate reports the first invalid field, naming it. Zero values are valid where they select
// a default.
func (c Config) Validate() error {
	if c.URL == "" {
		return errors.New("broker/amqp: Config.URL is empty")
	}
	if err := c.Topology.Validate(); err != nil {
		return err
	}
	return rules.Validate(c.fields().Settings(),
		inflight.Duration{Name: "AckDelay", Value: c.AckDelay},
		inflight.Duration{Name: "OutOfOrderAckDelay", Value: c.OutOfOrderAckDelay},
		inflight.Duration{Name: "ReconnectInitial", Value: c.ReconnectInitial},
		inflight.Duration{Name: "ReconnectMax", Value: c.ReconnectMax})
}

// withDefaults returns c with every zero field that has a default set to it, but Prefetch:
// each subscription takes its own window (rules.Window).
func (c Config) withDefaults() Config {
	rules.Default(c.fields())
	c.AckDelay = cmp.Or(c.AckDelay, DefaultAckDelay)
	c.OutOfOrderAckDelay = cmp.Or(c.OutOfOrderAckDelay, DefaultOutOfOrderAckDelay)
	c.OutOfOrderAckDelay = max(c.OutOfOrderAckDelay, c.AckDelay)
	c.ReconnectInitial = cmp.Or(c.ReconnectInitial, DefaultReconnectInitial)
	c.ReconnectMax = cmp.Or(c.ReconnectMax, DefaultReconnectMax)
	c.ReconnectMax = max(c.ReconnectMax, c.ReconnectInitial)
	return c
}
