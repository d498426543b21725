package redis

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Defaults of Config: each is the value of the field of its name when that field is zero.
const (
	// DefaultPrefetch is enough that one XREADGROUP and one XACK serve many messages, few
	// enough that the entries a dead consumer strands for AckTimeout stay few, and that the
	// consumers of a group share a backlog.
	DefaultPrefetch     = 100
	DefaultNackDelay    = time.Second
	DefaultAckTimeout   = 30 * time.Second
	DefaultBlockTime    = 100 * time.Millisecond
	DefaultCloseTimeout = 5 * time.Second
)

// maxPrefetch bounds Config.Prefetch: a subscription keeps a goroutine per unsettled delivery
// of a consumer that does not settle directly.
const maxPrefetch = 100_000

// Config configures a Subscriber. Only ConsumerGroup is required; every other zero field
// selects its default.
type Config struct {
	// ConsumerGroup is the Redis consumer group of the subscriptions. It is created on each
	// topic's stream when first subscribed (XGROUP CREATE ... 0 MKSTREAM), from the start of
	// the stream, so that it gets the entries published before it existed. Required.
	ConsumerGroup string

	// Prefetch is how many deliveries each subscription holds unsettled (neither acked nor
	// nacked) at most; it reads with XREADGROUP COUNT <room left> once half the window is free
	// (sooner after 20 ms, or a redelivery.Flush), so that one read brings many. A nacked
	// delivery leaves the window at once, whatever its delay. Defaults to DefaultPrefetch, or
	// to the window the consumer asks for when it subscribes (redelivery.WithWindow) when
	// that is larger.
	Prefetch int

	// NackDelay is how long a nacked entry waits before it is delivered again, unless the
	// consumer asked for another delay with redelivery.NackAfter. broker.NoNackDelay
	// redelivers at once. Defaults to DefaultNackDelay.
	NackDelay time.Duration

	// AckTimeout is how long a delivery may stay unsettled. When it passes, the delivery's
	// context is cancelled, and the entry, idle that long, may be claimed by any consumer of
	// the group. It must exceed the longest processing time. Defaults to DefaultAckTimeout.
	AckTimeout time.Duration

	// ClaimInterval is how often the entries that have been idle for AckTimeout are claimed:
	// one pass over the group's pending entries list per stream and Subscriber, whichever of
	// its subscriptions has room doing each step. Defaults to a tenth of AckTimeout, between
	// 100 ms and 1 s.
	ClaimInterval time.Duration

	// BlockTime is how long one XREADGROUP waits for new entries. It bounds how long Close
	// waits for a read in progress, and how late a nacked entry whose delay ends during a
	// read comes back. Defaults to DefaultBlockTime.
	BlockTime time.Duration

	// CloseTimeout bounds Close, and a subscription's end when its context ends: stopping the
	// reads, sending the acks given before, and giving back the unsettled deliveries. Defaults
	// to DefaultCloseTimeout.
	CloseTimeout time.Duration

	// Logger receives the subscriptions' logs. Defaults to no logging.
	Logger *slog.Logger

	log watermill.LoggerAdapter // Logger for the watermill adapters, made by the defaults
}

// rules are the defaults and bounds of the settings every subscriber has.
var rules = inflight.Rules{
	Scheme:        "redis",
	Prefetch:      DefaultPrefetch,
	MaxPrefetch:   maxPrefetch,
	AckTimeout:    DefaultAckTimeout,
	MinAckTimeout: 10 * time.Millisecond,
	NackDelay:     DefaultNackDelay,
	NoNackDelay:   true,
	CloseTimeout:  DefaultCloseTimeout,
}

func (c *Config) fields() inflight.Fields {
	return inflight.Fields{Prefetch: &c.Prefetch, AckTimeout: &c.AckTimeout, NackDelay: &c.NackDelay, CloseTimeout: &c.CloseTimeout, Logger: &c.Logger, Log: &c.log}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if c.ConsumerGroup == "" {
		return errors.New("redis: Config.ConsumerGroup is empty")
	}
	err := rules.Validate(c.fields().Settings(),
		inflight.Duration{Name: "ClaimInterval", Value: c.ClaimInterval},
		inflight.Duration{Name: "BlockTime", Value: c.BlockTime})
	if err != nil {
		return err
	}
	if c.BlockTime > 0 && c.BlockTime < time.Millisecond {
		// XREADGROUP counts in milliseconds, and BLOCK 0 waits for ever.
		return fmt.Errorf("redis: Config.BlockTime: %s is shorter than 1ms", c.BlockTime)
	}
	return nil
}

// withDefaults returns c with every zero field set to its default, but Prefetch: each
// subscription takes its own window (rules.Window).
func (c Config) withDefaults() Config {
	rules.Default(c.fields())
	if c.ClaimInterval == 0 {
		c.ClaimInterval = min(max(c.AckTimeout/10, 100*time.Millisecond), time.Second)
	}
	c.BlockTime = cmp.Or(c.BlockTime, DefaultBlockTime)
	return c
}
