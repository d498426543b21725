package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/sqldb"
)

// Relay defaults.
const (
	DefaultConsumerGroup  = "onceflow_relay"
	DefaultBatchSize      = 100
	DefaultPollInterval   = 100 * time.Millisecond
	DefaultResendInterval = time.Second
	DefaultRetryInterval  = time.Second
	DefaultAckDeadline    = 30 * time.Second
	DefaultCloseTimeout   = 30 * time.Second
)

// maxBatchSize bounds RelayConfig.BatchSize: a batch is one transaction.
const maxBatchSize = 10000

// ErrClosed is returned by Run on a Relay that has been closed.
var ErrClosed = errors.New("outbox: relay closed")

// RelayConfig configures a Relay.
type RelayConfig struct {
	// DB is the application database that holds the outbox. Required. On SQLite, relays of
	// one group take turns through the lock file <database file>.<messages table>.relay-<hash
	// of the group>.lock, which they create beside the database and leave in place; they must
	// therefore run on the machine that has the file.
	DB *sqldb.DB

	// Publisher sends the messages to the destination broker, each to the topic given to
	// Outbox.Publish, with its UUID, payload and metadata. Required. The relay does not close
	// it. It must return nil only once the broker has the message (publisher confirms on
	// AMQP, for instance): the relay then records the message as sent.
	Publisher message.Publisher

	// Table names the outbox, as Config.Table. Defaults to DefaultTable.
	Table string

	// ConsumerGroup names the relays that share the work: each message is sent by one relay of
	// the group, and the group's offset records how far it has got. Relays of different groups
	// each send every message. At most 255 bytes of UTF-8. Defaults to DefaultConsumerGroup.
	ConsumerGroup string

	// BatchSize is the number of messages a relay reads and sends at a time; their offset
	// commits when the batch ends, so a relay that dies sends its batch again. On PostgreSQL and
	// MySQL the batch is one transaction, which holds the consumer group's offsets row; Publish
	// never waits for it. At most 10000. Defaults to DefaultBatchSize.
	BatchSize int

	// PollInterval is how long a relay waits before looking again when it found nothing to
	// send. Defaults to DefaultPollInterval.
	PollInterval time.Duration

	// ResendInterval is how long a relay waits before it publishes again a message whose
	// publish failed. The message is published again, in order, until it succeeds: nothing
	// after it is sent meanwhile. Defaults to DefaultResendInterval.
	ResendInterval time.Duration

	// RetryInterval is how long a relay waits after reading the outbox failed. Defaults to
	// DefaultRetryInterval.
	RetryInterval time.Duration

	// AckDeadline bounds the time a message may take to be published, failed attempts
	// included. When it passes, the relay commits the offset of the messages sent before it
	// and starts a new batch with it. Defaults to DefaultAckDeadline.
	AckDeadline time.Duration

	// CloseTimeout bounds how long Close waits for the message being published. Defaults to
	// DefaultCloseTimeout.
	CloseTimeout time.Duration

	// Logger receives the relay's logs. Defaults to slog.Default().
	Logger *slog.Logger
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
	for _, d := range []struct {
		name  string
		value time.Duration
	}{
		{"PollInterval", c.PollInterval},
		{"ResendInterval", c.ResendInterval},
		{"RetryInterval", c.RetryInterval},
		{"AckDeadline", c.AckDeadline},
		{"CloseTimeout", c.CloseTimeout},
	} {
		if d.value < 0 {
			return fmt.Errorf("%s: %s is negative (0 selects the default)", d.name, d.value)
		}
	}
	return nil
}

// Relay sends the messages of an outbox to the destination broker, at least once, in the order
// of the outbox, with their UUID, payload and metadata, and resumes where its consumer group
// stopped. It is watermill's forwarder: the outbox rows are forwarder envelopes, read by a
// watermill-sql subscriber in the consumer group (on SQLite, by a subscriber of the same
// protocol that holds no write lock while it publishes), unwrapped, published to their topic,
// and acknowledged once the publish returned nil.
//
// A message is recorded as sent (its offset committed) only after the destination publish
// returned nil. A relay that dies between the two sends the message again when it, or another
// relay of the group, next runs: the destination's consumers must deduplicate, which onceflow's
// Deduplicate middleware does by message id. Relays of one group, on any number of nodes, take
// turns (on the group's offsets row on PostgreSQL and MySQL, on a lock file on SQLite), so in
// normal operation each message is sent once.
type Relay struct {
	cfg     RelayConfig
	ob      *Outbox
	logger  *slog.Logger
	fwd     *forwarder.Forwarder
	sub     *relaySubscriber
	backoff *backoff

	routerCtx  context.Context
	stopRouter context.CancelFunc
	killSub    context.CancelFunc

	mu      sync.Mutex
	started bool          // Run was called
	closed  bool          // Close (or kill) was called
	stop    chan struct{} // closed by Close: Run stops the relay
	done    chan struct{} // closed when Run returns
	stopErr error         // of stopping the relay; set before done closes
}

// NewRelay returns a relay for cfg, or an error naming the first invalid field. It does not
// touch the database.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("outbox.NewRelay: %w", err)
	}
	ob, err := New(cfg.DB, Config{Table: cfg.Table})
	if err != nil {
		return nil, err
	}
	cfg.Table = ob.table
	cfg.ConsumerGroup = cmp.Or(cfg.ConsumerGroup, DefaultConsumerGroup)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultBatchSize)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, DefaultPollInterval)
	cfg.ResendInterval = cmp.Or(cfg.ResendInterval, DefaultResendInterval)
	cfg.RetryInterval = cmp.Or(cfg.RetryInterval, DefaultRetryInterval)
	cfg.AckDeadline = cmp.Or(cfg.AckDeadline, DefaultAckDeadline)
	cfg.CloseTimeout = cmp.Or(cfg.CloseTimeout, DefaultCloseTimeout)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	logger := cfg.Logger.With("outbox", cfg.Table, "consumer_group", cfg.ConsumerGroup)
	wlog := watermill.NewSlogLoggerWithLevelMapping(logger, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})

	bo := &backoff{poll: cfg.PollInterval, retry: cfg.RetryInterval, logger: logger}
	schema, offsets := ob.d.schema(cfg.BatchSize), ob.d.offsets()
	var inner message.Subscriber
	if cfg.DB.Dialect == sqldb.SQLite {
		messages, _ := ob.Tables()
		inner = &sqliteSubscriber{
			db:          cfg.DB.DB.DB,
			schema:      schema,
			offsets:     offsets,
			group:       cfg.ConsumerGroup,
			lockPath:    relayLockPath(cfg.DB.Path, messages, cfg.ConsumerGroup),
			resend:      cfg.ResendInterval,
			ackDeadline: cfg.AckDeadline,
			backoff:     bo,
			closing:     make(chan struct{}),
		}
	} else {
		ackDeadline := cfg.AckDeadline
		inner, err = wsql.NewSubscriber(cfg.DB.DB.DB, wsql.SubscriberConfig{
			ConsumerGroup:    cfg.ConsumerGroup,
			AckDeadline:      &ackDeadline,
			PollInterval:     cfg.PollInterval,
			ResendInterval:   cfg.ResendInterval,
			RetryInterval:    cfg.RetryInterval,
			BackoffManager:   bo,
			SchemaAdapter:    schema,
			OffsetsAdapter:   offsets,
			InitializeSchema: false, // Migrate creates the tables
		}, wlog)
		if err != nil {
			return nil, fmt.Errorf("outbox.NewRelay: %w", err)
		}
	}
	subCtx, killSub := context.WithCancel(context.Background())
	sub := newRelaySubscriber(inner, subCtx, cfg.CloseTimeout)
	bo.ended = sub.signalMoved
	fwd, err := forwarder.NewForwarder(sub, cfg.Publisher, wlog, forwarder.Config{
		ForwarderTopic: cfg.Table,
		CloseTimeout:   cfg.CloseTimeout,
		Middlewares:    []message.HandlerMiddleware{withoutStack},
	})
	if err != nil {
		killSub()
		return nil, fmt.Errorf("outbox.NewRelay: %w", err)
	}
	routerCtx, stopRouter := context.WithCancel(context.Background())
	return &Relay{
		cfg:        cfg,
		ob:         ob,
		logger:     logger,
		fwd:        fwd,
		sub:        sub,
		backoff:    bo,
		routerCtx:  routerCtx,
		stopRouter: stopRouter,
		killSub:    killSub,
		stop:       make(chan struct{}),
		done:       make(chan struct{}),
	}, nil
}

// withoutStack replaces the forwarder's errors, which carry a github.com/pkg/errors stack
// trace that the router would log in full at every retry, by their message, and names the
// message and topic: the router's own log names the envelope, whose id is not the message's.
func withoutStack(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err != nil {
			var env struct {
				Topic string `json:"destination_topic"`
				UUID  string `json:"uuid"`
			}
			if json.Unmarshal(msg.Payload, &env) == nil && env.UUID != "" {
				return out, fmt.Errorf("message %s for topic %q: %s", env.UUID, env.Topic, err.Error())
			}
			err = errors.New(err.Error())
		}
		return out, err
	}
}

// Table returns the name of the outbox the relay sends.
func (r *Relay) Table() string { return r.cfg.Table }

// ConsumerGroup returns the relay's consumer group.
func (r *Relay) ConsumerGroup() string { return r.cfg.ConsumerGroup }

// Run registers the relay's consumer group in the offsets table (offset 0 for a new group),
// then sends messages until ctx ends or Close is called, and returns once the relay has
// stopped as Close describes. It fails at once when the outbox tables are missing (run
// Outbox.Migrate first). Run may be called once.
func (r *Relay) Run(ctx context.Context) (err error) {
	r.mu.Lock()
	switch {
	case r.closed:
		r.mu.Unlock()
		return ErrClosed
	case r.started:
		r.mu.Unlock()
		return errors.New("outbox: Relay.Run called twice")
	}
	r.started = true
	r.mu.Unlock()
	defer close(r.done)

	if err := r.checkTables(ctx); err != nil {
		r.release()
		return err
	}
	r.logger.Info("outbox relay starting", "batch_size", r.cfg.BatchSize)
	errCh := make(chan error, 1)
	go func() { errCh <- r.fwd.Run(r.routerCtx) }()
	select {
	case <-r.fwd.Running():
	case err := <-errCh:
		// The router could not subscribe (or Close came first). It cannot be closed: it would
		// wait for a handler that never started.
		r.release()
		if err == nil || errors.Is(err, ErrClosed) {
			return nil
		}
		return fmt.Errorf("outbox: relay of %s: %w", r.cfg.Table, err)
	}

	select {
	case err := <-errCh: // the subscription ended: the relay was killed
		r.release()
		return err
	case <-ctx.Done():
	case <-r.stop:
	}
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	// The router would report the end of its subscription as an error unless its context has
	// ended; the subscription itself does not depend on it.
	r.stopRouter()
	stopErr := errors.Join(r.sub.Close(), r.fwd.Close())
	r.killSub()
	if stopErr != nil {
		stopErr = fmt.Errorf("outbox: stop relay of %s: %w", r.cfg.Table, stopErr)
	}
	r.stopErr = stopErr
	r.logger.Info("outbox relay stopped")
	return errors.Join(<-errCh, stopErr)
}

// Close stops the relay: it publishes no further message, lets the publish in flight finish
// (for at most CloseTimeout), commits the offset of the messages sent, and returns when the
// relay has stopped. A message whose publish has not finished by then is sent again by the
// next relay of the group. Close does not close the destination publisher. It is safe to call
// more than once, concurrently with Run, and before Run.
func (r *Relay) Close() error {
	r.mu.Lock()
	if !r.closed {
		r.closed = true
		close(r.stop)
	}
	started := r.started
	r.mu.Unlock()
	if !started {
		r.release()
		return nil
	}
	<-r.done
	return r.stopErr
}

// release frees what a relay whose router is not running holds.
func (r *Relay) release() {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.sub.halt()
	r.stopRouter()
	_ = r.sub.Close()
	r.killSub()
}

// checkTables fails when one of the outbox's tables is missing.
func (r *Relay) checkTables(ctx context.Context) error {
	messages, offsets := r.ob.Tables()
	for _, t := range []string{messages, offsets} {
		rows, err := r.cfg.DB.QueryContext(ctx, `SELECT 1 FROM `+r.cfg.DB.Dialect.Quote(t)+` WHERE 1 = 0`)
		if err == nil {
			err = rows.Close()
		}
		if err != nil {
			return fmt.Errorf("outbox: relay of %s: cannot read table %s (has Outbox.Migrate run?): %w", r.cfg.Table, t, err)
		}
	}
	return nil
}

// kill stops the relay as a crash would: the batch's transaction rolls back, and every message
// sent in it is sent again by the next relay.
func (r *Relay) kill() {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.sub.halt()
	r.stopRouter()
	r.killSub()
}

// Stats returns the backlog and lag of the relay's consumer group; see Outbox.Stats.
func (r *Relay) Stats(ctx context.Context) (Stats, error) {
	return r.ob.Stats(ctx, r.cfg.ConsumerGroup)
}
