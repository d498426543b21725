package kafka

import (
	"cmp"
	"errors"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Defaults of Config: each is the value of the field of its name when that field is zero.
const (
	DefaultPrefetch      = 256 // one PollRecords and one offset commit serve many records
	DefaultAckTimeout    = 30 * time.Second
	DefaultRevokeTimeout = 5 * time.Second
	DefaultCloseTimeout  = 5 * time.Second
)

// maxPrefetch bounds Config.Prefetch: a subscription keeps a goroutine per unsettled delivery
// of a consumer that does not settle directly.
const maxPrefetch = 100_000

// Config configures a Subscriber. Brokers and ConsumerGroup are required; every other zero
// field selects its default.
type Config struct {
	// Brokers are the seed brokers, host:port. Required.
	Brokers []string

	// ConsumerGroup is the Kafka consumer group of the subscriptions: the subscriptions of one
	// group share the partitions of a topic, every group gets every record. A group that has
	// committed no offset for a partition starts at the partition's first record. Required.
	ConsumerGroup string

	// Prefetch is how many records each subscription holds unsettled (handed out or waiting
	// to be) at most: it polls with PollRecords(room left). A nacked record leaves the window
	// while it waits. Defaults to DefaultPrefetch, or to the window the consumer asks for when
	// it subscribes (redelivery.WithWindow) when that is larger.
	Prefetch int

	// NackDelay is how long a nacked record waits before it is handed out again, unless the
	// consumer asked for another delay with redelivery.NackAfter. Zero hands it out again at
	// once.
	NackDelay time.Duration

	// AckTimeout is how long a delivery may stay unsettled. When it passes, the delivery ends
	// (ErrAckTimeout) and the record is handed out again. Kafka itself has no such timeout:
	// an unsettled record holds back the commits of its partition. Defaults to
	// DefaultAckTimeout.
	AckTimeout time.Duration

	// SessionTimeout is the group session timeout of each member: a member that the group
	// coordinator has not heard from for that long loses its partitions to the others. The
	// brokers bound it (group.min.session.timeout.ms, 6 s by default, and
	// group.max.session.timeout.ms). Members heartbeat every tenth of it, 3 s at most.
	// Defaults to kgo's default, 45 s.
	SessionTimeout time.Duration

	// RevokeTimeout is how long a member whose partitions the group takes away waits for
	// their deliveries in flight to settle before it commits and lets them go; those still
	// unsettled end (ErrRevoked). The group's rebalance waits for it: its rebalance timeout
	// is RevokeTimeout + 10 s for a commit in flight + CloseTimeout + 5 s, 25 s with the
	// defaults (kgo.RebalanceTimeout in ClientOptions overrides it). Defaults to
	// DefaultRevokeTimeout.
	RevokeTimeout time.Duration

	// CloseTimeout bounds the offset commits of a closing subscription. Defaults to
	// DefaultCloseTimeout.
	CloseTimeout time.Duration

	// Topics creates the topics that Subscribe finds missing. Nil creates them with the
	// brokers' default partition count and replication factor.
	Topics *Topics

	// ClientOptions are passed to kgo.NewClient after the seed brokers, the session timeout
	// and the rebalance timeout, and before the subscriber's own options (the consumer group,
	// the topic, manual commits, the rebalance callbacks), which they must not replace: dial
	// timeouts, TLS, SASL, heartbeat interval.
	ClientOptions []kgo.Opt

	// Logger receives the subscriptions' logs. Defaults to no logging.
	Logger *slog.Logger

	log watermill.LoggerAdapter // Logger for the watermill adapters, made by the defaults
}

// rules are the defaults and bounds of the settings every subscriber has.
var rules = inflight.Rules{
	Scheme:       "kafka",
	Prefetch:     DefaultPrefetch,
	MaxPrefetch:  maxPrefetch,
	AckTimeout:   DefaultAckTimeout,
	CloseTimeout: DefaultCloseTimeout,
}

func (c *Config) fields() inflight.Fields {
	return inflight.Fields{Prefetch: &c.Prefetch, AckTimeout: &c.AckTimeout, NackDelay: &c.NackDelay, CloseTimeout: &c.CloseTimeout, Logger: &c.Logger, Log: &c.log}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case len(c.Brokers) == 0:
		return errors.New("kafka: Config.Brokers is empty")
	case c.ConsumerGroup == "":
		return errors.New("kafka: Config.ConsumerGroup is empty")
	}
	return rules.Validate(c.fields().Settings(),
		inflight.Duration{Name: "SessionTimeout", Value: c.SessionTimeout},
		inflight.Duration{Name: "RevokeTimeout", Value: c.RevokeTimeout})
}

// withDefaults returns c with every zero field that has a default set to it, but Prefetch:
// each subscription takes its own window (rules.Window).
func (c Config) withDefaults() Config {
	rules.Default(c.fields())
	c.RevokeTimeout = cmp.Or(c.RevokeTimeout, DefaultRevokeTimeout)
	return c
}
