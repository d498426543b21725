package sqlitequeue

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// Default configuration values, chosen for an embedded queue: small batches so that the write
// lock a consumer holds while its handler runs is held briefly, and short intervals so that
// latency stays low.
const (
	DefaultConsumerGroup  = "default"
	DefaultBatchSize      = 16
	DefaultPollInterval   = 20 * time.Millisecond
	DefaultResendInterval = 50 * time.Millisecond
	DefaultRetryInterval  = time.Second
	DefaultAckDeadline    = 30 * time.Second
)

// maxBatchSize bounds BatchSize: a batch is consumed under one write lock.
const maxBatchSize = 10000

// Config configures a Queue. The zero value is valid: every field has a default.
type Config struct {
	// ConsumerGroup names the consumer group of the subscribers the queue makes. Every consumer
	// group receives every message of a topic; within a group, each message goes to one
	// subscription at a time and the group's offset advances only when it is acknowledged.
	// Defaults to "default".
	ConsumerGroup string

	// BatchSize is the number of messages a subscription reads in one transaction. The
	// transaction, and with it the queue file's write lock, stays open until the last message
	// of the batch is acknowledged, so a larger batch lets publishers wait longer. A consumer
	// that dies mid-batch leaves the whole batch to be delivered again. Defaults to 16.
	BatchSize int

	// PollInterval is how long a subscription waits before looking again when it found no
	// message. Defaults to 20 ms.
	PollInterval time.Duration

	// ResendInterval is how long a subscription waits before delivering a nacked message again.
	// Defaults to 50 ms.
	ResendInterval time.Duration

	// RetryInterval is how long a subscription waits after a failed query (other than a busy
	// database, which is retried after PollInterval). Defaults to 1 s.
	RetryInterval time.Duration

	// AckDeadline is how long a delivered message may stay neither acked nor nacked, counted
	// from its first delivery in the batch. When it passes, the message's context is cancelled,
	// what was published in its delivery's transaction is rolled back, the batch ends (about a
	// second later) committing the messages acknowledged before it, and the message is
	// delivered again. Defaults to 30 s.
	AckDeadline time.Duration

	// Logger receives the subscribers' logs. Defaults to no logging.
	Logger watermill.LoggerAdapter
}

// Validate reports the first invalid field. Zero values are valid: they select the defaults.
func (c Config) Validate() error {
	if len(c.ConsumerGroup) > 255 {
		return fmt.Errorf("sqlitequeue: Config.ConsumerGroup: %d bytes is longer than 255", len(c.ConsumerGroup))
	}
	if c.BatchSize < 0 || c.BatchSize > maxBatchSize {
		return fmt.Errorf("sqlitequeue: Config.BatchSize: %d is outside 1..%d (0 selects the default)", c.BatchSize, maxBatchSize)
	}
	for _, d := range []struct {
		name  string
		value time.Duration
	}{
		{"PollInterval", c.PollInterval},
		{"ResendInterval", c.ResendInterval},
		{"RetryInterval", c.RetryInterval},
		{"AckDeadline", c.AckDeadline},
	} {
		if d.value < 0 {
			return fmt.Errorf("sqlitequeue: Config.%s: %s is negative (0 selects the default)", d.name, d.value)
		}
	}
	return nil
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	if c.ConsumerGroup == "" {
		c.ConsumerGroup = DefaultConsumerGroup
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.ResendInterval == 0 {
		c.ResendInterval = DefaultResendInterval
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = DefaultRetryInterval
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = DefaultAckDeadline
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	return c
}
