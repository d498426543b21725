package onceflow

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/sqldb"
)

// DefaultDeadLetterTopic is the dead-letter topic when Config.DeadLetterTopic is empty.
const DefaultDeadLetterTopic = "onceflow_dead_letter"

// Config configures a Router.
type Config struct {
	// DeadLetterPublisher receives messages that failed permanently: a malformed payload, a
	// message without an id, an error made by processor.Permanent. Required: without a
	// dead-letter topic such a message could only be redelivered forever or dropped.
	DeadLetterPublisher message.Publisher

	// DeadLetterTopic is the topic dead-lettered messages are published to. Defaults to
	// DefaultDeadLetterTopic.
	DeadLetterTopic string

	// Logger receives the router's structured logs. Defaults to slog.Default(). Info-level
	// entries never contain payloads or credentials.
	Logger *slog.Logger

	// CloseTimeout bounds how long Close waits for messages in flight to finish. Defaults to
	// 30 s. A message still in flight when it passes is not acknowledged; the broker redelivers
	// it.
	CloseTimeout time.Duration

	// PurgeInterval is how often the router purges expired duplicate-detection keys of its
	// handlers' stores. Defaults to 1 h; a negative value disables the purge loop (run
	// `onceflow purge` instead). Only one node purges a store at a time.
	PurgeInterval time.Duration

	// PurgeBatchSize is how many keys one purge statement deletes. Defaults to
	// sqldb.DefaultPurgeBatchSize (1000).
	PurgeBatchSize int

	// SkipMigrate stops Run from creating the tables its handlers need (duplicate detection,
	// ordering). Defaults to false: Run creates them if missing.
	SkipMigrate bool

	// TracerProvider, MeterProvider and Propagator are used by the tracing and metrics
	// interceptors and by the router's own spans and metrics. Each defaults to the global one
	// from go.opentelemetry.io/otel. The Propagator reads the parent context from the headers
	// of incoming messages and writes it into dead-lettered ones; the global default
	// propagates nothing until the application sets one. docs/observability.md lists every
	// span and metric.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	Propagator     propagation.TextMapPropagator
}

// Validate reports the first invalid field of c, by name.
func (c Config) Validate() error {
	if c.DeadLetterPublisher == nil {
		return errors.New("Config.DeadLetterPublisher: nil (permanent failures and messages without an id need a dead-letter topic)")
	}
	if c.DeadLetterTopic != "" && !validTopic(c.DeadLetterTopic) {
		return fmt.Errorf("Config.DeadLetterTopic: %q is not a valid topic name (letters, digits, '_', '-' and '.')", c.DeadLetterTopic)
	}
	if c.CloseTimeout < 0 {
		return fmt.Errorf("Config.CloseTimeout: %s is negative", c.CloseTimeout)
	}
	if c.PurgeBatchSize < 0 {
		return fmt.Errorf("Config.PurgeBatchSize: %d is negative", c.PurgeBatchSize)
	}
	return nil
}

func (c *Config) setDefaults() {
	if c.DeadLetterTopic == "" {
		c.DeadLetterTopic = DefaultDeadLetterTopic
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.PurgeInterval == 0 {
		c.PurgeInterval = time.Hour
	}
	if c.PurgeBatchSize == 0 {
		c.PurgeBatchSize = sqldb.DefaultPurgeBatchSize
	}
}

func validTopic(s string) bool {
	if s == "" || len(s) > 200 {
		return false
	}
	for _, r := range s {
		ok := r == '_' || r == '-' || r == '.' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9')
		if !ok {
			return false
		}
	}
	return true
}
