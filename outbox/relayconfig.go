package outbox

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// DB is the application database that holds the outbox. Required. On SQLite, the relays
	// that purge take turns through the lock file <database file>.<messages table>.purge.lock,
	// which they create beside the database and leave in place; they must therefore run on the
	// machine that has the file.
	DB *sqldb.DB

	// Publisher sends the messages to the destination broker, each to the topic given to
	// Outbox.Publish, with its UUID, payload and metadata. Required. The relay does not close
	// it. It must return nil only once the broker has the message (publisher confirms on
	// AMQP, for instance): the relay then records the message as sent.
	Publisher message.Publisher

	// Table names the outbox, as Config.Table. Defaults to DefaultTable.
	Table string

	// ConsumerGroup names the relays that share the work: each message is sent by one relay of
	// the group, normally once, and the group's cursor and leases record how far it has got.
	// Relays of different groups each send every message. At most 255 bytes of UTF-8.
	// Defaults to DefaultConsumerGroup.
	ConsumerGroup string

	// BatchSize is the window of each relay: how many messages it claims at most, each under
	// a lease of AckDeadline, before it has sent them. It sends them one at a time. At most
	// 10000. Defaults to DefaultBatchSize.
	BatchSize int

	// PollInterval is how long an idle relay waits before it looks for new messages again.
	// A relay hears of Publishes sooner: from the Outbox of the same process, and on
	// PostgreSQL from a notification (see Relay). Defaults to DefaultPollInterval.
	PollInterval time.Duration

	// ResendInterval is the delay before a message whose publish failed is published again,
	// doubled at each further delivery of the message up to MaxResendInterval. The messages
	// behind it are sent meanwhile. When the destination fails every message, the relay
	// pauses for the same growing delays. Defaults to DefaultResendInterval.
	ResendInterval time.Duration

	// MaxResendInterval bounds the delay of ResendInterval; it is at least ResendInterval.
	// Defaults to DefaultMaxResendInterval.
	MaxResendInterval time.Duration

	// MaxAttempts is the delivery count at which a message that the destination keeps
	// failing, while it accepts other messages, is given up: published to DeadLetterTopic
	// with the reason, and acknowledged. Failures while the destination fails every message
	// do not give a message up. Defaults to DefaultMaxAttempts.
	MaxAttempts int

	// Refused reports whether an error of Publisher says that publishing the message again
	// cannot succeed: too large for the broker, invalid. Such a message is dead-lettered at
	// its first failure. Defaults to processor.IsPermanent; a relay to NATS might add
	// errors.Is(err, nats.ErrMaxPayload).
	Refused func(err error) bool

	// DeadLetterPublisher receives the messages given up, on DeadLetterTopic, with the
	// headers of middleware.PublishDeadLetter (the reason, the destination topic in
	// onceflow_dlq_topic, the delivery count) and, when it refuses them too, under a derived
	// id and then without their payload: a dead letter is never refused for its own sake. The
	// relay does not close it. Defaults to Publisher.
	DeadLetterPublisher message.Publisher

	// DeadLetterTopic is the topic of the messages given up. Defaults to
	// DefaultDeadLetterTopic.
	DeadLetterTopic string

	// RetryInterval is how long a relay waits after reading the outbox failed, and before it
	// listens for notifications again. Defaults to DefaultRetryInterval.
	RetryInterval time.Duration

	// AckDeadline is the lease of a claimed message: a message not sent (nor given back)
	// within it is claimed again, by any relay of the group, with its delivery count one
	// higher. It bounds how long the messages of a relay that died wait, and must exceed the
	// destination's longest publish. Defaults to DefaultAckDeadline.
	AckDeadline time.Duration

	// CloseTimeout bounds how long Close waits for the message being published. Defaults to
	// DefaultCloseTimeout.
	CloseTimeout time.Duration

	// PurgeInterval is how often a relay deletes, in bounded batches, the messages that every
	// consumer group of the outbox has sent (Outbox.Purge), in the turn of one process at a
	// time. A negative interval disables it. Defaults to DefaultPurgeInterval.
	PurgeInterval time.Duration

	// PurgeBatchSize is the number of rows one DELETE of the purge removes at most. Defaults to
	// DefaultPurgeBatchSize.
	PurgeBatchSize int

	// Logger receives the relay's logs. Defaults to slog.Default().
	Logger *slog.Logger

	// SkipMigrate makes Run use the outbox's tables as they are, failing at once when one is
	// missing, instead of creating the missing ones first (Outbox.Migrate): for databases
	// whose application user may not create tables, where `onceflow migrate --outbox` ran
	// ahead.
	SkipMigrate bool
}

// Validate reports the first invalid field of c, by name. Zero values select the defaults.
func (c RelayConfig) Validate() error {
	if c.DB == nil || c.DB.DB == nil {
		return errors.New("DB: is nil")
	}
	if c.Publisher == nil {
		return errors.New("Publisher: is nil")
	}
	if err := (Config{Table: c.Table}).Validate(); err != nil {
		return err
	}
	if len(c.ConsumerGroup) > 255 || !utf8.ValidString(c.ConsumerGroup) {
		return fmt.Errorf("ConsumerGroup: %q is not at most 255 bytes of UTF-8", c.ConsumerGroup)
	}
	if c.BatchSize < 0 || c.BatchSize > maxBatchSize {
		return fmt.Errorf("BatchSize: %d is outside 1..%d (0 selects the default)", c.BatchSize, maxBatchSize)
	}
	if c.MaxAttempts < 0 {
		return fmt.Errorf("MaxAttempts: %d is negative (0 selects the default)", c.MaxAttempts)
	}
	if c.PurgeBatchSize < 0 {
		return fmt.Errorf("PurgeBatchSize: %d is negative (0 selects the default)", c.PurgeBatchSize)
	}
	for _, d := range []struct {
		name  string
		value time.Duration
	}{
		{"PollInterval", c.PollInterval},
		{"ResendInterval", c.ResendInterval},
		{"MaxResendInterval", c.MaxResendInterval},
		{"RetryInterval", c.RetryInterval},
		{"AckDeadline", c.AckDeadline},
		{"CloseTimeout", c.CloseTimeout},
	} {
		if d.value < 0 {
			return fmt.Errorf("%s: %s is negative (0 selects the default)", d.name, d.value)
		}
	}
	if c.AckDeadline > 0 && c.AckDeadline < time.Millisecond {
		return fmt.Errorf("AckDeadline: %s is shorter than 1ms (0 selects the default)", c.AckDeadline)
	}
	return nil
}

// withDefaults returns c, valid, with every zero field set to its default.
func (c RelayConfig) withDefaults(table string) RelayConfig {
	c.Table = table
	c.ConsumerGroup = cmp.Or(c.ConsumerGroup, DefaultConsumerGroup)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.ResendInterval = cmp.Or(c.ResendInterval, DefaultResendInterval)
	if c.MaxResendInterval == 0 {
		c.MaxResendInterval = max(DefaultMaxResendInterval, c.ResendInterval)
	}
	c.MaxResendInterval = max(c.MaxResendInterval, c.ResendInterval)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	if c.Refused == nil {
		c.Refused = processor.IsPermanent
	}
	if c.DeadLetterPublisher == nil {
		c.DeadLetterPublisher = c.Publisher
	}
	c.DeadLetterTopic = cmp.Or(c.DeadLetterTopic, DefaultDeadLetterTopic)
	c.RetryInterval = cmp.Or(c.RetryInterval, DefaultRetryInterval)
	c.AckDeadline = cmp.Or(c.AckDeadline, DefaultAckDeadline)
	c.CloseTimeout = cmp.Or(c.CloseTimeout, DefaultCloseTimeout)
	c.PurgeInterval = cmp.Or(c.PurgeInterval, DefaultPurgeInterval)
	c.PurgeBatchSize = cmp.Or(c.PurgeBatchSize, DefaultPurgeBatchSize)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}
