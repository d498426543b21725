package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Relay defaults.
const (
	DefaultConsumerGroup     = "onceflow_relay"
	DefaultBatchSize         = 100
	DefaultPollInterval      = 100 * time.Millisecond
	DefaultResendInterval    = time.Second
	DefaultMaxResendInterval = time.Minute
	DefaultMaxAttempts       = 5
	DefaultRetryInterval     = time.Second
	DefaultAckDeadline       = 30 * time.Second
	DefaultCloseTimeout      = 30 * time.Second
	DefaultPurgeInterval     = time.Minute
	// DefaultDeadLetterTopic is the dead-letter topic of a relay whose DeadLetterTopic is
	// empty: the router's default (onceflow.DefaultDeadLetterTopic), so that `onceflow dlq`
	// lists and replays what relays dead-letter beside what handlers do.
	DefaultDeadLetterTopic = "onceflow_dead_letter"
)

// maxBatchSize bounds RelayConfig.BatchSize: the window is claimed in one statement and held
// in memory.
const maxBatchSize = 10000

// ErrClosed is returned by Run on a Relay that has been closed.
var ErrClosed = errors.New("outbox: relay closed")

// Relay sends the messages of an outbox to the destination broker, at least once, normally
// once, with their UUID, payload and metadata.
//
// A relay is one consumer of its consumer group over the outbox's tables, which it reads as
// onceflow's SQL queues read a topic (broker/sqlqueue on PostgreSQL and MySQL,
// broker/sqlitequeue on SQLite): it claims up to BatchSize committed messages under leases,
// in short transactions, and sends them one at a time. Any number of relays, on any nodes,
// share the work: they claim different messages, and each message is sent by one of them
// while its lease runs. A message is recorded as sent (its lease deleted) only after the
// destination publish returned nil; a relay that dies between the two leaves the message to
// the others once its lease (AckDeadline) passes, and it is sent again with the same UUID: the
// destination's consumers must deduplicate, which onceflow's Deduplicate middleware does by
// message id.
//
// A message whose publish fails is sent again after ResendInterval, doubled at each further
// delivery, while the messages behind it go on. One that the destination keeps failing while
// it accepts others (too large, invalid) is given up at its MaxAttempts-th delivery, at once
// when Refused says so: it goes to DeadLetterTopic with the reason, and the relay goes on.
// When the destination fails every message (two different messages in a row, nothing
// accepted in between), the relay takes it to be down: it holds the message it has and
// publishes it again, in place, after growing pauses, until the destination takes it; such
// failures give no message up. It then goes on in order.
//
// Order: one relay sends the messages in the order of the outbox (the order their
// transactions became visible), except those it had to send again, which come after the
// ones behind them. Several relays send in parallel, in no particular order. Consumers that
// need the order of a key get it from ExactlyOnceInOrder (package ordering), whose sequence
// numbers are assigned in the producing transaction and which reorders by them: it does not
// rely on the relay's order.
//
// A relay claims new messages as soon as it hears of a Publish, and looks again 1, 2, 4, ...
// ms later until the Publish's transaction has committed: Outbox.Publish in this process tells
// it directly, and on PostgreSQL it also listens for the notification that Publish sends
// (Config.NotifyInTransaction). Relays in other processes find MySQL and SQLite messages at
// their next poll (PollInterval). Every PurgeInterval, one relay of the outbox at a time
// deletes what every consumer group has sent.
type Relay struct {
	cfg     RelayConfig
	ob      *Outbox
	logger  *slog.Logger
	src     source
	health  *health
	handler string // the dead letters' handler header

	published chan struct{} // the relay heard of a Publish (see wake.go)
	received  atomic.Int64  // when the loop last took a message, in Unix nanoseconds
	killed    atomic.Bool   // stop as a crash would: settle nothing more

	mu       sync.Mutex
	started  bool          // Run was called
	closed   bool          // Close (or kill) was called
	stop     chan struct{} // closed by Close: Run stops the relay
	stopping chan struct{} // closed when the relay begins to stop
	done     chan struct{} // closed when Run returns
	stopErr  error         // of stopping the relay; set before done closes
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
	cfg = cfg.withDefaults(ob.table)
	cfg.Logger = cfg.Logger.With("outbox", cfg.Table, "consumer_group", cfg.ConsumerGroup)
	src, err := ob.d.newSource(cfg)
	if err != nil {
		return nil, fmt.Errorf("outbox.NewRelay: %w", err)
	}
	return &Relay{
		cfg:       cfg,
		ob:        ob,
		logger:    cfg.Logger,
		src:       src,
		health:    newHealth(),
		handler:   "outbox:" + cfg.Table,
		published: make(chan struct{}, 1),
		stop:      make(chan struct{}),
		stopping:  make(chan struct{}),
		done:      make(chan struct{}),
	}, nil
}

// Table returns the name of the outbox the relay sends.
func (r *Relay) Table() string { return r.cfg.Table }

// ConsumerGroup returns the relay's consumer group.
func (r *Relay) ConsumerGroup() string { return r.cfg.ConsumerGroup }

// Run creates the outbox's tables if they are missing (as Outbox.Migrate does, unless
// RelayConfig.SkipMigrate), registers the relay's consumer group in the offsets table (at the
// start of the outbox for a new group), then sends messages until ctx ends or Close is
// called, and returns once the relay has stopped as Close describes. A relay may therefore
// start before or after the router whose handlers publish to the outbox. Run may be called
// once.
func (r *Relay) Run(ctx context.Context) error {
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

	if !r.cfg.SkipMigrate {
		if err := r.ob.Migrate(ctx); err != nil {
			r.release()
			return fmt.Errorf("outbox: relay of %s: create the tables: %w", r.cfg.Table, err)
		}
	}
	if err := r.checkTables(ctx); err != nil {
		r.release()
		return err
	}
	// The subscription ends only when the relay has stopped: its end gives back what is not
	// sent and writes what is.
	subCtx, endSub := context.WithCancel(context.Background())
	defer endSub()
	msgs, err := r.src.subscribe(subCtx)
	if err != nil {
		r.release()
		return fmt.Errorf("outbox: relay of %s: %w", r.cfg.Table, err)
	}
	helpers, stopHelpers := context.WithCancel(context.Background())
	var running sync.WaitGroup
	running.Go(func() { r.chase(helpers) })
	if l, ok := r.ob.d.(listener); ok {
		running.Go(func() { r.listen(helpers, l) })
	}
	if r.cfg.PurgeInterval > 0 {
		running.Go(func() { r.purgeLoop(helpers) })
	}
	registerLocal(r)
	// A transaction that published before the relay could hear of it may commit after the
	// subscription's first claim: chase it, as for a Publish the relay heard.
	r.hear()
	r.logger.Info("outbox relay starting", "batch_size", r.cfg.BatchSize)

	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		r.loop(msgs)
	}()
	select {
	case <-ctx.Done():
	case <-r.stop:
	case <-loopDone:
	}
	r.beginStopping()
	timer := time.NewTimer(r.cfg.CloseTimeout)
	select {
	case <-loopDone:
	case <-timer.C:
		r.logger.Warn("outbox relay: the message being published did not finish within the close timeout; the next relay sends it again", "close_timeout", r.cfg.CloseTimeout)
	}
	timer.Stop()
	unregisterLocal(r)
	stopHelpers()
	running.Wait()
	if err := r.src.close(); err != nil {
		r.stopErr = fmt.Errorf("outbox: stop relay of %s: %w", r.cfg.Table, err)
	}
	r.logger.Info("outbox relay stopped")
	return r.stopErr
}

// loop sends the messages of the subscription, one at a time, until the relay stops.
func (r *Relay) loop(msgs <-chan *message.Message) {
	for {
		select {
		case <-r.stop:
			return
		case <-r.stopping:
			return
		case msg, ok := <-msgs:
			if !ok {
				return
			}
			r.received.Store(time.Now().UnixNano())
			r.send(msg)
		}
	}
}

// beginStopping marks the relay closed and tells the loop to take no further message.
func (r *Relay) beginStopping() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	select {
	case <-r.stopping:
	default:
		close(r.stopping)
	}
}

// isStopping reports whether the relay has been asked to stop, or has begun to.
func (r *Relay) isStopping() bool {
	select {
	case <-r.stop:
		return true
	case <-r.stopping:
		return true
	default:
		return false
	}
}

// Close stops the relay: it publishes no further message, lets the publish in flight finish
// (for at most CloseTimeout), writes the acknowledgements of the messages sent, gives back
// the others to the group at once, and returns when the relay has stopped. A message whose
// publish has not finished by then is sent again by the next relay of the group. Close does
// not close the destination publisher. It is safe to call more than once, concurrently with
// Run, and before Run.
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

// release frees what a relay that is not running holds.
func (r *Relay) release() {
	r.beginStopping()
	_ = r.src.close()
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
			return fmt.Errorf("outbox: relay of %s: cannot read table %s (create it with Outbox.Migrate or onceflow migrate --outbox): %w", r.cfg.Table, t, err)
		}
	}
	return nil
}

// kill stops the relay as a crash would: the message being published is not recorded as
// sent, whatever the destination answers, and is sent again by the next relay.
func (r *Relay) kill() {
	r.killed.Store(true)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		r.closed = true
		close(r.stop)
	}
}

// Stats returns the backlog and lag of the relay's consumer group; see Outbox.Stats.
func (r *Relay) Stats(ctx context.Context) (Stats, error) {
	return r.ob.Stats(ctx, r.cfg.ConsumerGroup)
}
