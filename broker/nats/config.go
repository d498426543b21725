package nats

import (
	"errors"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats.go"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Defaults of Config: each is the value of the field of its name when that field is zero.
const (
	// DefaultPrefetch is small: JetStream's AckWait runs from each delivery, also while it
	// waits for its turn in the consumer, so the window must drain well within AckWait; 64
	// keeps the fetch round trips (one per half window, or per redelivery.Flush) out of the way.
	DefaultPrefetch     = 64
	DefaultAckWait      = 30 * time.Second
	DefaultCloseTimeout = 5 * time.Second
)

// Config configures a Subscriber. URL and ConsumerGroup are required; the other fields have
// defaults.
type Config struct {
	// URL names the NATS server, or several separated by commas, as nats.Connect takes it,
	// credentials included. Required.
	URL string

	// ConnectOptions are passed to nats.Connect after a connection name ("onceflow subscriber
	// <group>") and reconnecting for ever, which they may replace, and before the handlers of
	// a lost connection, which they must not replace.
	ConnectOptions []nats.Option

	// ConsumerGroup names the durable consumer that the subscriptions pull from, with the
	// topic (ConsumerName). Subscriptions of one group compete for the messages; every group
	// gets every message. Required.
	ConsumerGroup string

	// Prefetch is how many deliveries each subscription holds unsettled at most. Defaults to
	// DefaultPrefetch, or to the window the consumer asks for when it subscribes
	// (redelivery.WithWindow) when that is larger.
	Prefetch int

	// AckWait is how long a delivery may stay unsettled before JetStream delivers the message
	// again; the delivery's context is cancelled when it passes. Subscribe sets it on the
	// group's consumer. Defaults to DefaultAckWait.
	AckWait time.Duration

	// NackDelay is how long a nacked message waits before JetStream delivers it again, when
	// the nack does not ask for a delay of its own (redelivery.NackAfter). Zero delivers it
	// again at once.
	NackDelay time.Duration

	// CloseTimeout bounds how long Close waits for the server to confirm the
	// acknowledgements given before Close. Defaults to DefaultCloseTimeout.
	CloseTimeout time.Duration

	// Logger receives the subscriber's logs. Defaults to no logging.
	Logger *slog.Logger

	log watermill.LoggerAdapter // Logger for the watermill adapters, made by the defaults
}

// rules are the defaults and bounds of the settings every subscriber has.
var rules = inflight.Rules{
	Scheme:          "nats",
	Prefetch:        DefaultPrefetch,
	AckTimeout:      DefaultAckWait,
	AckTimeoutField: "AckWait",
	CloseTimeout:    DefaultCloseTimeout,
}

func (c *Config) fields() inflight.Fields {
	return inflight.Fields{Prefetch: &c.Prefetch, AckTimeout: &c.AckWait, NackDelay: &c.NackDelay, CloseTimeout: &c.CloseTimeout, Logger: &c.Logger, Log: &c.log}
}

// Validate reports the first invalid field. Zero values select the defaults, except for URL
// and ConsumerGroup, which are required.
func (c Config) Validate() error {
	switch {
	case c.URL == "":
		return errors.New("nats: Config.URL is empty")
	case c.ConsumerGroup == "":
		return errors.New("nats: Config.ConsumerGroup is empty")
	}
	return rules.Validate(c.fields().Settings())
}

// withDefaults returns c with every zero field that has a default set to it, but Prefetch:
// each subscription takes its own window (rules.Window).
func (c Config) withDefaults() Config {
	rules.Default(c.fields())
	return c
}
