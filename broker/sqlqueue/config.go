package sqlqueue

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Defaults of Config.
const (
	DefaultConsumerGroup = "default"
	DefaultPrefetch      = 10
	DefaultAckTimeout    = 30 * time.Second
	DefaultPollInterval  = 50 * time.Millisecond
	DefaultRetryInterval = time.Second
	DefaultCloseTimeout  = 5 * time.Second
	DefaultGapWait       = 2 * time.Second
)

// MaxPrefetch bounds Config.Prefetch: each delivery in flight holds a lease row, and a
// goroutine unless its consumer settles directly (redelivery.WithDirectSettle).
const MaxPrefetch = 10000

// Config configures a Queue. The zero value is valid: every field has a default.
type Config struct {
	// ConsumerGroup names the consumer group (package broker) of the Queue's subscribers.
	// Defaults to DefaultConsumerGroup.
	ConsumerGroup string

	// Prefetch is how many deliveries each subscription holds unsettled at most, claimed
	// without waiting for their acknowledgements; it claims again once half of them are
	// settled, or PollInterval after the first is. Defaults to DefaultPrefetch, or to the
	// window the consumer asks for (redelivery.WithWindow) when that is larger; at most
	// MaxPrefetch.
	Prefetch int

	// AckTimeout is the length of a lease: a delivery neither acked nor nacked within it has
	// its context cancelled, and the message is claimed again, by any subscription of the
	// group, with its delivery count one higher. It bounds how long the messages of a
	// consumer that died stay unavailable. Defaults to DefaultAckTimeout.
	AckTimeout time.Duration

	// NackDelay is how long a nacked message waits before it can be claimed again, when the
	// nack did not ask for a delay of its own (redelivery.NackAfter). Zero, the default, makes
	// it available at once.
	NackDelay time.Duration

	// PollInterval is how long an idle subscription waits before it looks for messages again.
	// A subscription that found messages looks again at once while it has room. Defaults to
	// DefaultPollInterval.
	PollInterval time.Duration

	// RetryInterval is how long a subscription, or the writing of acknowledgements, waits
	// after a failed query before it tries again. A transient conflict (deadlock, serialization
	// failure) is retried after PollInterval. Defaults to DefaultRetryInterval.
	RetryInterval time.Duration

	// CloseTimeout bounds Subscriber.Close. Defaults to DefaultCloseTimeout.
	CloseTimeout time.Duration

	// GapWait is, on MySQL and MariaDB, how long a missing offset holds back the messages
	// after it: an AUTO_INCREMENT offset is allocated before its row is written, so a claim
	// takes only consecutive offsets after the cursor, and passes a gap once the message after
	// it is GapWait old (the gap is then a publish that rolled back, or a removed message).
	// created_at keeps whole seconds: keep it above a second. Defaults to DefaultGapWait.
	// Unused on PostgreSQL.
	GapWait time.Duration

	// Logger receives the subscribers' logs. Defaults to no logging.
	Logger *slog.Logger

	log watermill.LoggerAdapter // Logger for the watermill adapters, made by the defaults

	// Tables names the tables of a topic, for tables laid out as the queue's but named
	// otherwise (onceflow's transactional outbox keeps its messages so). Every name must be 1
	// to 63 bytes without quote characters; the topic is then only a key, not limited to
	// MaxTopic. Nil, the default, selects DefaultTables, the names that watermill-sql's
	// publishers and subscribers use.
	Tables func(topic string) Tables
}

// rules are the defaults and bounds of the settings every subscriber has.
var rules = inflight.Rules{
	Scheme:       "sqlqueue",
	Prefetch:     DefaultPrefetch,
	MaxPrefetch:  MaxPrefetch,
	AckTimeout:   DefaultAckTimeout,
	CloseTimeout: DefaultCloseTimeout,
}

func (c *Config) fields() inflight.Fields {
	return inflight.Fields{Prefetch: &c.Prefetch, AckTimeout: &c.AckTimeout, NackDelay: &c.NackDelay, CloseTimeout: &c.CloseTimeout, Logger: &c.Logger, Log: &c.log}
}

// Validate reports the first invalid field. Zero values are valid: they select the defaults.
func (c Config) Validate() error {
	if len(c.ConsumerGroup) > 255 {
		return fmt.Errorf("sqlqueue: Config.ConsumerGroup: %d bytes is longer than 255 (the consumer_group column)", len(c.ConsumerGroup))
	}
	return rules.Validate(c.fields().Settings(),
		inflight.Duration{Name: "PollInterval", Value: c.PollInterval},
		inflight.Duration{Name: "RetryInterval", Value: c.RetryInterval},
		inflight.Duration{Name: "GapWait", Value: c.GapWait})
}

// withDefaults returns c with every zero field that has a default set to it, but Prefetch:
// each subscription takes its own window (rules.Window).
func (c Config) withDefaults() Config {
	c.ConsumerGroup = cmp.Or(c.ConsumerGroup, DefaultConsumerGroup)
	rules.Default(c.fields())
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.RetryInterval = cmp.Or(c.RetryInterval, DefaultRetryInterval)
	c.GapWait = cmp.Or(c.GapWait, DefaultGapWait)
	return c
}
