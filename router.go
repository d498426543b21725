package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
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
	cfg          Config
	logger       *slog.Logger
	instruments  *telemetry.Instruments
	interceptors map[string]InterceptorFactory

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

// handlerClaim is a handler name and the topic it consumes, recorded in its dedup store's
// database when the router runs.
type handlerClaim struct {
	store       *dedup.SQLStore
	name, topic string
}

type storeKey struct {
	db    *sqldb.DB
	table string
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
	r.interceptors = r.builtinInterceptors()
	return r, nil
}

// AddHandler adds h to the router. It validates h and builds its chain, and returns an error
// naming the offending field when h is invalid. Handlers must be added before Run.
func (r *Router) AddHandler(h Handler) error {
	if err := h.Validate(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.names[h.Name] {
		return fmt.Errorf("Handler.Name: %q is already used by another handler", h.Name)
	}
	names := h.interceptorNames()
	if err := checkOrder(names); err != nil {
		return err
	}
	grouped := slices.ContainsFunc(names, func(n string) bool { return slices.Contains(groupInterceptors, n) })
	if h.BatchProcessor != nil {
		if last := names[len(names)-1]; !slices.Contains(groupInterceptors, last) {
			return fmt.Errorf("Handler.BatchProcessor: the chain must end with one of %q, which hand the batch to it (handler %q ends with %q)",
				groupInterceptors, h.Name, last)
		}
	}

	// The dedup table is created only for chains that record keys: a chain that relies on
	// natural idempotency has none.
	store := h.Dedup.Store
	if store == nil && recordsKeys(names) {
		s, err := r.storeFor(h)
		if err != nil {
			return err
		}
		store = s
		r.claims = append(r.claims, handlerClaim{store: s, name: h.Name, topic: h.Topic})
	}
	system, group := describeBroker(h)
	info := HandlerInfo{
		Name:            h.Name,
		Topic:           h.Topic,
		DB:              h.DB,
		Dedup:           store,
		Logger:          r.logger.With("handler", h.Name),
		Handler:         h,
		MessagingSystem: system,
		ConsumerGroup:   group,
	}
	mws, err := r.buildChain(info, names)
	if err != nil {
		return err
	}
	// The onceflow.process span is innermost: one per attempt, around the user's processor only.
	var inner processor.Processor = batchOnly{}
	if h.Processor != nil {
		inner = traceProcessor(h.Processor)
	}
	chain := wrap(mws, inner)

	// A message that cannot be converted goes through the interceptors that do not touch the
	// database, to a processor that fails permanently with the conversion error: it is traced,
	// counted and dead-lettered like any other permanent failure.
	var outer []string
	for _, n := range names {
		if n == InterceptorTracing || n == InterceptorMetrics || n == InterceptorDeadLetter {
			outer = append(outer, n)
		}
	}
	if !slices.Contains(outer, InterceptorDeadLetter) {
		outer = append(outer, InterceptorDeadLetter)
	}
	rejectMWs, err := r.buildChain(info, outer)
	if err != nil {
		return err
	}
	reject := wrap(rejectMWs, processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
		return processor.Permanent(ctx.Value(convErrKey{}).(error))
	}))

	n := max(h.Concurrency, 1)
	c := &consumer{
		router:       r,
		name:         h.Name,
		topic:        h.Topic,
		conv:         h.converter(),
		chain:        chain,
		reject:       reject,
		ackOnReceipt: h.QoS == BestEffort,
		redelivery:   h.Redelivery,
		logger:       info.Logger,
		attrs:        metric.WithAttributeSet(attribute.NewSet(middleware.AttrHandler.String(h.Name))),
		settlement:   newSettlement(h.Topic, system, group),
	}
	c.recordAttrs = []metric.RecordOption{c.attrs}
	if grouped {
		// Enough deliveries for every group transaction to run full, and the next group to
		// collect: more would only wait, each in a goroutine of its own.
		size := h.GroupCommit.MaxSize
		if size == 0 {
			size = middleware.DefaultMaxGroupSize
		}
		c.slots = make(chan struct{}, (n+1)*size)
	} else {
		c.slots = make(chan struct{}, n)
	}
	if h.QoS != BestEffort && h.MaxDeliveries >= 0 && slices.Contains(names, InterceptorDeadLetter) {
		counter, err := r.counterFor(h)
		if err != nil {
			return err
		}
		c.counter = counter
	}
	if windowed := slices.Contains(names, InterceptorGroupOffsets); windowed || slices.Contains(names, InterceptorOffsets) {
		p, err := r.positionsFor(h)
		if err != nil {
			return err
		}
		c.positions = handlerPositions{positions: p, handler: h.Name}
		c.positionWindow, c.shared = windowed, windowed
	}
	c.sub = &onceClosingSubscriber{Subscriber: h.Subscriber}
	c.subscriptions = n
	r.handlers = append(r.handlers, c)
	r.names[h.Name] = true
	r.initHandlerMetrics(h.Name)
	return nil
}

// interceptorNames returns the names of h's chain, outermost first: Interceptors, or the QoS
// chain with h's duplicate detection.
func (h Handler) interceptorNames() []string {
	if len(h.Interceptors) > 0 {
		return h.Interceptors
	}
	names := chainFor(h.QoS, h.GroupCommit.Enabled || h.BatchProcessor != nil)
	dedup := h.Dedup.interceptor()
	if dedup == InterceptorDeduplicate {
		return names
	}
	names = slices.Clone(names)
	i := slices.Index(names, InterceptorGroupCommit)
	switch {
	case i < 0:
		names[slices.Index(names, InterceptorDeduplicate)] = dedup
	case dedup == InterceptorOffsets:
		names[i] = InterceptorGroupOffsets
	default: // acknowledged in the group's transaction, member by member
		names[i] = InterceptorGroupTransaction
		names = slices.Insert(names, i+1, dedup)
	}
	return names
}

// describeBroker returns the messaging.system and consumer group of h's broker: what
// h.MessagingSystem says, else what the subscriber says (onceflow's brokers say both), else
// middleware.DefaultMessagingSystem and no group.
func describeBroker(h Handler) (system, group string) {
	system = h.MessagingSystem
	if d, ok := h.Subscriber.(interface{ MessagingSystem() string }); ok && system == "" {
		system = d.MessagingSystem()
	}
	if system == "" {
		system = middleware.DefaultMessagingSystem
	}
	if g, ok := h.Subscriber.(interface{ ConsumerGroup() string }); ok {
		group = g.ConsumerGroup()
	}
	return system, group
}

// batchOnly is the innermost processor of a handler with a BatchProcessor: the group-commit
// interceptor hands the messages to the batch processor and never calls it.
type batchOnly struct{}

func (batchOnly) Process(context.Context, *messagedata.MessageData) error {
	return errors.New("onceflow: a handler with a BatchProcessor reached its per-message processor (the chain must end with group commit)")
}

// counterFor returns the delivery counter of h's database, one per database and table.
func (r *Router) counterFor(h Handler) (*dedup.Counter, error) {
	key := storeKey{db: h.DB, table: dedup.DefaultCounterTable}
	if c, ok := r.counters[key]; ok {
		return c, nil
	}
	c, err := dedup.NewCounter(h.DB, dedup.CounterConfig{Retention: h.Dedup.Retention})
	if err != nil {
		return nil, fmt.Errorf("Handler.MaxDeliveries: %w", err)
	}
	r.counters[key] = c
	return c, nil
}

// positionsFor returns the positions table of h's database, one per database, which Migrate
// creates. The caller holds r.mu.
func (r *Router) positionsFor(h Handler) (*dedup.Positions, error) {
	key := storeKey{db: h.DB, table: dedup.DefaultPositionsTable}
	if p, ok := r.positions[key]; ok {
		return p, nil
	}
	p, err := dedup.NewPositions(h.DB, dedup.PositionsConfig{})
	if err != nil {
		return nil, fmt.Errorf("Handler.Dedup.ByOffset: %w", err)
	}
	r.positions[key] = p
	r.migrate = append(r.migrate, p.Migrate)
	return p, nil
}

// handlerPositions are one handler's positions, for its subscriber: where it starts each
// partition, and that it hands out each partition's messages in order (one at a time, or
// several at once with group commit: consumer.positionWindow).
type handlerPositions struct {
	positions *dedup.Positions
	handler   string
}

func (p handlerPositions) Applied(ctx context.Context, topic string) (map[int32]int64, error) {
	return p.positions.Load(ctx, p.handler, topic)
}

func (r *Router) storeFor(h Handler) (*dedup.SQLStore, error) {
	table := h.Dedup.Table
	if table == "" {
		table = dedup.DefaultTable
	}
	key := storeKey{db: h.DB, table: table}
	if s, ok := r.stores[key]; ok {
		return s, nil
	}
	s, err := dedup.New(h.DB, dedup.Config{Table: table, Retention: h.Dedup.Retention})
	if err != nil {
		return nil, fmt.Errorf("Handler.Dedup: %w", err)
	}
	r.stores[key] = s
	return s, nil
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
	gauges, err := r.registerDedupGauges()
	if err != nil {
		return err
	}
	defer func() { _ = gauges.Unregister() }()
	purgeCtx, stopPurge := context.WithCancel(ctx)
	defer stopPurge()
	if r.cfg.PurgeInterval > 0 {
		go r.purgeLoop(purgeCtx)
	}
	stopOrdering, err := r.startOrdering(ctx)
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
	for _, c := range r.handlers {
		ctx := subCtx
		switch {
		case c.positionWindow:
			ctx = redelivery.WithPositionWindow(subCtx, c.positions)
		case c.positions != nil:
			ctx = redelivery.WithPositions(subCtx, c.positions)
		}
		for range c.subscriptions {
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
		}
	}
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
		}()
	}
	for i, msgs := range chans {
		go func() {
			defer r.readers.Done()
			defer readers[owners[i]].Done()
			owners[i].read(msgs)
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

// claimHandlers records, in each dedup store's database, the topic each handler consumes, and
// fails when another process uses one of the handler names for another topic: the handler name,
// not the topic, is part of every duplicate-detection key, so the two would take each other's
// messages for duplicates.
func (r *Router) claimHandlers(ctx context.Context) error {
	r.mu.Lock()
	claims := append([]handlerClaim(nil), r.claims...)
	r.mu.Unlock()
	for _, c := range claims {
		if err := c.store.ClaimHandler(ctx, c.name, c.topic); err != nil {
			return fmt.Errorf("Handler.Name: %w", err)
		}
	}
	return nil
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
	stores := make([]*dedup.SQLStore, 0, len(r.stores))
	for _, s := range r.stores {
		stores = append(stores, s)
	}
	counters := make([]*dedup.Counter, 0, len(r.counters))
	for _, c := range r.counters {
		counters = append(counters, c)
	}
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
		stores := make([]*dedup.SQLStore, 0, len(r.stores))
		for _, s := range r.stores {
			stores = append(stores, s)
		}
		counters := make([]*dedup.Counter, 0, len(r.counters))
		for _, c := range r.counters {
			counters = append(counters, c)
		}
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

func wrap(mws []middleware.Middleware, p processor.Processor) processor.Processor {
	for i := len(mws) - 1; i >= 0; i-- {
		p = mws[i](p)
	}
	return p
}
