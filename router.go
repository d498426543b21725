package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
)

// Router consumes messages and runs each through its handler's chain of interceptors, then
// acknowledges or rejects it. It reads the message channels of watermill Subscribers itself,
// Handler.Concurrency subscriptions per handler, and runs each delivery in a goroutine of its
// own.
//
// The router is the only place where an outcome becomes an ack or a nack:
//
//	outcome of the chain                       broker sees
//	nil (committed)                            ack, after the commit
//	duplicate (processor.ErrDuplicate)         ack, nothing applied again
//	permanent error, message not convertible   published to the dead-letter topic, then ack;
//	                                           nack if that publish fails
//	retryable error, after in-process retries  nack: the broker redelivers
//	panic                                      nack, after the rollback
//
// BestEffort handlers are the exception by design: they ack on receipt, before processing.
// No message is acknowledged before its transaction's outcome is known; a commit whose outcome
// is unknown (connection lost during COMMIT) is not acknowledged, and duplicate detection
// absorbs the redelivery.
type Router struct {
	cfg         Config
	logger      *slog.Logger
	instruments *telemetry.Instruments

	mu       sync.Mutex
	names    map[string]bool
	stores   map[storeKey]*dedup.SQLStore
	orders   orderRegistry
	migrate  []func(context.Context) error
	gate     gate
	holds    holds
	counters map[storeKey]*dedup.Counter
	// positions are the position tables of the handlers whose duplicate detection is by
	// offset, one per database.
	positions map[storeKey]*dedup.Positions
	claims    []handlerClaim
	handlers  []*consumer
	started   bool

	running  chan struct{} // closed once every handler has subscribed
	closing  chan struct{} // closed when Close begins
	done     chan struct{} // closed when Close has ended
	stopSubs context.CancelFunc
	readers  sync.WaitGroup
	closeErr error
	closed   sync.Once
}

// NewRouter returns a Router for cfg, or an error naming the first invalid field.
func NewRouter(cfg Config) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	ins, err := telemetry.NewInstruments(telemetry.Meter(mp))
	if err != nil {
		return nil, fmt.Errorf("create metric instruments: %w", err)
	}
	r := &Router{
		cfg:         cfg,
		running:     make(chan struct{}),
		closing:     make(chan struct{}),
		done:        make(chan struct{}),
		logger:      cfg.Logger,
		instruments: ins,
		names:       map[string]bool{},
		stores:      map[storeKey]*dedup.SQLStore{},
		counters:    map[storeKey]*dedup.Counter{},
		positions:   map[storeKey]*dedup.Positions{},
		gate:        gate{idle: make(chan struct{})},
	}
	return r, nil
}

// AddHandler adds h to the router: it validates h (Handler.Validate), builds its chain, and
// makes the consumer that subscribes to h.Topic when Run starts. It returns an error naming the
// offending field when h is invalid. Handlers must be added before Run.
func (r *Router) AddHandler(h Handler) error {
	if err := h.Validate(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.names[h.Name] {
		return fmt.Errorf("Handler.Name: %q is already used by another handler", h.Name)
	}
	p := planOf(h)
	store, err := r.dedupStore(h, p)
	if err != nil {
		return err
	}
	env := &stageEnv{HandlerInfo: handlerInfo(h, store, r.logger), plan: p}
	ch, err := buildChains(r, env)
	if err != nil {
		return err
	}
	c, err := newConsumer(r, env, ch)
	if err != nil {
		return err
	}
	r.handlers = append(r.handlers, c)
	r.names[h.Name] = true
	initHandlerMetrics(r.instruments, h.Name)
	return nil
}

// AddMigration registers fn to run before the handlers start, unless Config.SkipMigrate is
// set. Components that need tables of their own (the outbox, ordering) use it.
func (r *Router) AddMigration(fn func(context.Context) error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.migrate = append(r.migrate, fn)
}

// Run creates the tables the handlers need (unless Config.SkipMigrate), starts the purge loop,
// the ordering sweepers of ExactlyOnceInOrder handlers and the handlers, and blocks until ctx
// ends, Close is called, or every subscription has ended by itself (its subscriber closed its
// message channel; a router without handlers waits for ctx or Close). When ctx ends, or the subscriptions do, it closes the router gracefully, as
// Close does, and returns Close's error. A subscription that fails returns its error. Run
// runs once. While
// it runs, the gauges of the dedup tables (onceflow.dedup.*) and of parked messages
// (onceflow.order.parked) are observed on Config.MeterProvider.
func (r *Router) Run(ctx context.Context) error {
	if !r.cfg.SkipMigrate {
		if err := r.Migrate(ctx); err != nil {
			return err
		}
	}
	if err := r.claimHandlers(ctx); err != nil {
		return err
	}
	gauges, err := registerDedupGauges(r.cfg.MeterProvider, r.logger, r.dedupStores)
	if err != nil {
		return err
	}
	defer func() { _ = gauges.Unregister() }()
	r.mu.Lock()
	handlers := append([]*consumer(nil), r.handlers...)
	r.mu.Unlock()
	paused, err := registerPausedGauge(r.cfg.MeterProvider, handlers)
	if err != nil {
		return err
	}
	defer func() { _ = paused.Unregister() }()
	purgeCtx, stopPurge := context.WithCancel(ctx)
	defer stopPurge()
	if r.cfg.PurgeInterval > 0 {
		go r.purgeLoop(purgeCtx)
	}
	stopOrdering, err := r.orders.start(ctx, r.cfg.MeterProvider, r.logger)
	if err != nil {
		return err
	}
	defer stopOrdering()

	ended, err := r.subscribe(ctx)
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		return r.Close()
	case <-ended: // every subscription has ended by itself
		return r.Close()
	case <-r.closing:
		<-r.done
		return nil
	}
}

// subscribe subscribes each handler Handler.Concurrency times and starts reading the
// subscriptions. The returned channel is closed when every subscription has ended; it is nil
// when there is none.
func (r *Router) subscribe(ctx context.Context) (<-chan struct{}, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.started {
		return nil, errors.New("onceflow: the router is running already")
	}
	r.started = true
	select {
	case <-r.closing:
		return nil, errors.New("onceflow: the router is closed")
	default:
	}
	// The subscriptions outlive ctx: Close ends them, after the deliveries in flight.
	// The router settles every message it receives itself (redelivery.Settle after each ack
	// or nack), so that a subscriber need not wait on each message's channels.
	subCtx, stop := context.WithCancel(redelivery.WithDirectSettle(context.WithoutCancel(ctx)))
	r.stopSubs = stop
	var chans []<-chan *message.Message
	var owners []*consumer
	var subs []int // each subscription's number among its handler's
	for _, c := range r.handlers {
		ctx := redelivery.WithWindow(subCtx, c.window)
		switch {
		case c.positionWindow:
			ctx = redelivery.WithPositionWindow(ctx, c.positions)
		case c.positions != nil:
			ctx = redelivery.WithPositions(ctx, c.positions)
		}
		for sub := range c.subscriptions {
			msgs, err := c.sub.Subscribe(ctx, c.topic)
			if err != nil {
				stop()
				for _, c := range r.handlers {
					_ = c.sub.Close()
				}
				return nil, fmt.Errorf("handler %q: subscribe to topic %q: %w", c.name, c.topic, err)
			}
			chans = append(chans, msgs)
			owners = append(owners, c)
			subs = append(subs, sub)
		}
	}
	setStates(r.handlers, StateRunning, "", "")
	ended := make(chan struct{})
	r.readers.Add(len(chans))
	readers := make(map[*consumer]*sync.WaitGroup, len(r.handlers))
	for _, c := range r.handlers {
		c.work = make(chan *message.Message)
		wg := &sync.WaitGroup{}
		wg.Add(c.subscriptions)
		readers[c] = wg
		go func() {
			wg.Wait()
			close(c.work) // the idle workers end
			c.stats.set(StateStopped, "its subscriptions ended", StateRunning)
		}()
	}
	for i, msgs := range chans {
		go func() {
			defer r.readers.Done()
			defer readers[owners[i]].Done()
			owners[i].read(msgs, subs[i])
		}()
	}
	go func() {
		r.readers.Wait()
		close(ended)
	}()
	close(r.running)
	if len(chans) == 0 {
		return nil, nil // no handler: Run waits for ctx or Close
	}
	return ended, nil
}

// Running is closed once every handler has subscribed.
func (r *Router) Running() chan struct{} { return r.running }

// Close stops the router gracefully: deliveries that arrive from now on are nacked without
// being processed, deliveries in flight finish (commit and ack) for at most
// Config.CloseTimeout, then the subscribers are closed and Close waits, again for at most
// Config.CloseTimeout, for their message channels to close. A message whose transaction has not
// committed is never acknowledged. Close is safe to call more than once, and concurrently; every
// call returns when the router is closed, with the same error.
func (r *Router) Close() error {
	r.closed.Do(func() {
		defer close(r.done)
		close(r.closing)
		r.mu.Lock()
		setStates(r.handlers, StateStopped, "the router closed", StateRunning)
		r.mu.Unlock()
		idle := r.gate.close()
		r.holds.release() // failed messages held for their redelivery delay go back now
		timeout := time.NewTimer(r.cfg.CloseTimeout)
		defer timeout.Stop()
		select {
		case <-idle:
		case <-timeout.C:
			r.logger.Warn("close timeout passed with messages in flight; they will be redelivered", "timeout", r.cfg.CloseTimeout)
		}
		r.mu.Lock()
		stop, handlers := r.stopSubs, r.handlers
		r.mu.Unlock()
		if stop == nil {
			return // never ran
		}
		stop()
		var errs []error
		for _, c := range handlers {
			if err := c.sub.Close(); err != nil {
				errs = append(errs, fmt.Errorf("close the subscriber of handler %q: %w", c.name, err))
			}
		}
		ended := make(chan struct{})
		go func() {
			r.readers.Wait()
			close(ended)
		}()
		select {
		case <-ended:
		case <-time.After(r.cfg.CloseTimeout):
			errs = append(errs, fmt.Errorf("onceflow: close timeout: subscriptions still open after %s", r.cfg.CloseTimeout))
		}
		r.closeErr = errors.Join(errs...)
	})
	<-r.done
	return r.closeErr
}

// Migrate creates the tables of the handlers' duplicate-detection stores, of their ordering
// state (ExactlyOnceInOrder) and of registered components, if missing. Run calls it unless
// Config.SkipMigrate is set.
func (r *Router) Migrate(ctx context.Context) error {
	r.mu.Lock()
	stores, counters := slices.Collect(maps.Values(r.stores)), slices.Collect(maps.Values(r.counters))
	extra := append([]func(context.Context) error(nil), r.migrate...)
	r.mu.Unlock()
	for _, s := range stores {
		if err := s.Migrate(ctx); err != nil {
			return fmt.Errorf("migrate dedup table %s: %w", s.Table(), err)
		}
	}
	for _, c := range counters {
		if err := c.Migrate(ctx); err != nil {
			return err
		}
	}
	if err := r.orders.migrate(ctx); err != nil {
		return err
	}
	for _, fn := range extra {
		if err := fn(ctx); err != nil {
			return err
		}
	}
	return nil
}

func (r *Router) purgeLoop(ctx context.Context) {
	for {
		// Jitter spreads the nodes; the store's lock keeps all but one idle anyway.
		wait := r.cfg.PurgeInterval/2 + rand.N(r.cfg.PurgeInterval)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		r.mu.Lock()
		stores, counters := slices.Collect(maps.Values(r.stores)), slices.Collect(maps.Values(r.counters))
		r.mu.Unlock()
		for _, c := range counters {
			res, err := c.Purge(ctx, dedup.PurgeOptions{BatchSize: r.cfg.PurgeBatchSize})
			if err != nil {
				r.logger.Error("purge of old delivery counts failed", "table", c.Table(), "error", err)
			} else if !res.Skipped && res.Deleted > 0 {
				r.logger.Info("purged old delivery counts", "table", c.Table(), "deleted", res.Deleted)
			}
		}
		for _, s := range stores {
			res, err := s.Purge(ctx, dedup.PurgeOptions{BatchSize: r.cfg.PurgeBatchSize})
			switch {
			case err != nil:
				r.logger.Error("purge of expired dedup keys failed", "table", s.Table(), "error", err)
			case res.Skipped:
				r.logger.Debug("purge skipped: another node is purging", "table", s.Table())
			default:
				r.logger.Info("purged expired dedup keys", "table", s.Table(), "deleted", res.Deleted, "batches", res.Batches)
			}
		}
	}
}
