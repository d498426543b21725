package sqlitequeue

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/internal/queuetable"
	"github.com/onceflow/onceflow/internal/wmlog"
)

// Default configuration values, chosen for an embedded queue: a window that keeps a router's
// handlers busy without leasing far ahead of them, and short intervals so that latency stays
// low.
const (
	DefaultConsumerGroup  = "default"
	DefaultBatchSize      = queuetable.DefaultBatchSize
	DefaultPollInterval   = 20 * time.Millisecond
	DefaultResendInterval = 50 * time.Millisecond
	DefaultRetryInterval  = time.Second
	DefaultAckDeadline    = 30 * time.Second
)

// maxBatchSize bounds BatchSize: a subscription holds its window in memory and claims it in one
// transaction, which holds the file's write lock.
const maxBatchSize = 10000

// minLease is the smallest AckDeadline and ResendInterval: leases are kept in milliseconds.
const minLease = time.Millisecond

// Config configures a Queue. The zero value is valid: every field has a default.
type Config struct {
	// ConsumerGroup names the consumer group (package broker) of the subscribers the queue
	// makes. At most 255 bytes. Defaults to "default".
	ConsumerGroup string

	// BatchSize is the window of each subscription: how many messages it holds delivered and
	// not yet settled at most, each under a lease; the messages of a consumer that dies wait
	// for their leases to expire. 1 to 10000. Defaults to 16, or to the window the consumer
	// asks for (redelivery.WithWindow) when that is larger.
	BatchSize int

	// PollInterval is how long an idle subscription waits before it looks for messages again.
	// A publish through a Queue of the same process wakes the subscriptions of its topic at
	// once. Defaults to 20 ms.
	PollInterval time.Duration

	// ResendInterval is the delay of a nack that asks for none (redelivery.NackAfter); the
	// messages behind it are delivered meanwhile. At least 1 ms. Defaults to 50 ms.
	ResendInterval time.Duration

	// RetryInterval is how long a subscription waits after a failed query (other than a busy
	// database, which is retried after PollInterval). Defaults to 1 s.
	RetryInterval time.Duration

	// AckDeadline is the lease: how long a delivered message may stay unsettled, or the
	// messages of a consumer that died wait. When it passes, the delivery's context is
	// cancelled and the message may be claimed again, by any consumer of the group, with its
	// delivery count one higher. At least 1 ms. Defaults to 30 s.
	AckDeadline time.Duration

	// Logger receives the subscribers' logs. Defaults to no logging.
	Logger *slog.Logger

	log watermill.LoggerAdapter // Logger for the watermill adapters, made by the defaults
}

// Validate reports the first invalid field. Zero values are valid: they select the defaults.
func (c Config) Validate() error {
	if len(c.ConsumerGroup) > 255 {
		return fmt.Errorf("sqlitequeue: Config.ConsumerGroup: %d bytes is longer than 255", len(c.ConsumerGroup))
	}
	return rules.Validate(inflight.Settings{Prefetch: c.BatchSize, AckTimeout: c.AckDeadline},
		inflight.Duration{Name: "PollInterval", Value: c.PollInterval},
		inflight.Duration{Name: "ResendInterval", Value: c.ResendInterval, Min: minLease},
		inflight.Duration{Name: "RetryInterval", Value: c.RetryInterval})
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	c.ConsumerGroup = cmp.Or(c.ConsumerGroup, DefaultConsumerGroup)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.ResendInterval = cmp.Or(c.ResendInterval, DefaultResendInterval)
	c.RetryInterval = cmp.Or(c.RetryInterval, DefaultRetryInterval)
	c.AckDeadline = cmp.Or(c.AckDeadline, DefaultAckDeadline)
	c.Logger = cmp.Or(c.Logger, wmlog.Discard())
	c.log = wmlog.Adapter(c.Logger)
	return c
}

// rules check Config's bounds and give each subscription its window (Config.BatchSize).
var rules = inflight.Rules{
	Scheme: "sqlitequeue", Prefetch: DefaultBatchSize, MaxPrefetch: maxBatchSize, PrefetchField: "BatchSize",
	AckTimeout: DefaultAckDeadline, AckTimeoutField: "AckDeadline", MinAckTimeout: minLease,
}
