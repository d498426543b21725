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

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// Router consumes messages and runs each through its handler's chain of interceptors, then
// acknowledges or rejects it. It is built on watermill's message.Router.
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
	wr           *message.Router
	logger       *slog.Logger
	instruments  *telemetry.Instruments
	interceptors map[string]InterceptorFactory

	mu       sync.Mutex
	names    map[string]bool
	stores   map[storeKey]*dedup.SQLStore
	orders   orderRegistry
	migrate  []func(context.Context) error
	gate     gate
	closeErr error
	closed   sync.Once
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
	wlog := watermill.NewSlogLoggerWithLevelMapping(cfg.Logger, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})
	wr, err := message.NewRouter(message.RouterConfig{CloseTimeout: cfg.CloseTimeout}, wlog)
	if err != nil {
		return nil, fmt.Errorf("create watermill router: %w", err)
	}
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	ins, err := telemetry.NewInstruments(mp.Meter(telemetry.ScopeName))
	if err != nil {
		return nil, fmt.Errorf("create metric instruments: %w", err)
	}
	r := &Router{
		cfg:         cfg,
		wr:          wr,
		logger:      cfg.Logger,
		instruments: ins,
		names:       map[string]bool{},
		stores:      map[storeKey]*dedup.SQLStore{},
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
	names := h.Interceptors
	if len(names) == 0 {
		names = chainFor(h.QoS, h.GroupCommit.Enabled)
	}
	if err := checkOrder(names); err != nil {
		return err
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
	}
	info := HandlerInfo{
		Name:    h.Name,
		Topic:   h.Topic,
		DB:      h.DB,
		Dedup:   store,
		Logger:  r.logger.With("handler", h.Name),
		Handler: h,
	}
	mws, err := r.buildChain(info, names)
	if err != nil {
		return err
	}
	// The onceflow.process span is innermost: one per attempt, around the user's processor only.
	chain := wrap(mws, traceProcessor(h.Processor))

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

	hd := &handler{
		router:       r,
		name:         h.Name,
		topic:        h.Topic,
		conv:         converter.New(converter.Config{IDHeader: h.IDHeader}),
		chain:        chain,
		reject:       reject,
		ackOnReceipt: h.QoS == BestEffort,
		slots:        make(chan struct{}, max(h.Concurrency, 1)),
		logger:       info.Logger,
		attrs:        metric.WithAttributeSet(attribute.NewSet(middleware.AttrHandler.String(h.Name))),
	}
	sub := &onceClosingSubscriber{Subscriber: h.Subscriber}
	n := max(h.Concurrency, 1)
	for i := range n {
		name := h.Name
		if n > 1 {
			name = fmt.Sprintf("%s#%d", h.Name, i+1)
		}
		r.wr.AddConsumerHandler(name, h.Topic, sub, hd.handle)
	}
	r.names[h.Name] = true
	r.initHandlerMetrics(h.Name)
	return nil
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
// ends or Close is called. When ctx ends it closes the router gracefully, as Close does. While
// it runs, the gauges of the dedup tables (onceflow.dedup.*) and of parked messages
// (onceflow.order.parked) are observed on Config.MeterProvider.
func (r *Router) Run(ctx context.Context) error {
	if !r.cfg.SkipMigrate {
		if err := r.Migrate(ctx); err != nil {
			return err
		}
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

	errCh := make(chan error, 1)
	go func() { errCh <- r.wr.Run(context.WithoutCancel(ctx)) }()
	select {
	case err := <-errCh:
		return err
	case <-ctx.Done():
		closeErr := r.Close()
		runErr := <-errCh
		return errors.Join(runErr, closeErr)
	}
}

// Running is closed once every handler has subscribed.
func (r *Router) Running() chan struct{} { return r.wr.Running() }

// Close stops the router gracefully: deliveries that arrive from now on are nacked without
// being processed, deliveries in flight finish (commit and ack) for at most
// Config.CloseTimeout, then the subscriptions are closed. A message whose transaction has not
// committed is never acknowledged. Close is safe to call more than once.
func (r *Router) Close() error {
	r.closed.Do(func() {
		idle := r.gate.close()
		select {
		case <-idle:
		case <-time.After(r.cfg.CloseTimeout):
			r.logger.Warn("close timeout passed with messages in flight; they will be redelivered", "timeout", r.cfg.CloseTimeout)
		}
		r.closeErr = r.wr.Close()
	})
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
	extra := append([]func(context.Context) error(nil), r.migrate...)
	r.mu.Unlock()
	for _, s := range stores {
		if err := s.Migrate(ctx); err != nil {
			return fmt.Errorf("migrate dedup table %s: %w", s.Table(), err)
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
		r.mu.Unlock()
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

type convErrKey struct{}

// handler is one Handler at run time.
type handler struct {
	router       *Router
	name         string
	topic        string
	conv         *converter.Converter
	chain        processor.Processor
	reject       processor.Processor
	ackOnReceipt bool
	// slots bounds the deliveries being processed after an ack on receipt to Concurrency: the
	// subscriber hands over the next message as soon as one is acked, and watermill runs each
	// in a goroutine of its own, so without it a BestEffort handler would take every message
	// the broker has, each holding a database connection.
	slots  chan struct{}
	logger *slog.Logger
	attrs  metric.MeasurementOption
}

// handle is the watermill handler function. It acks or nacks the message itself and always
// returns nil, so that watermill's own ack after a nil return is a no-op.
func (h *handler) handle(msg *message.Message) error {
	if !h.router.gate.enter() {
		msg.Nack()
		return nil
	}
	defer h.router.gate.leave()

	st := &delivery.State{Handler: h.name, Received: time.Now()}
	ctx := delivery.With(msg.Context(), st)
	if h.ackOnReceipt {
		h.slots <- struct{}{}
		defer func() { <-h.slots }()
		msg.Ack()
		// The delivery is over for the broker, and subscribers end a message's context once it
		// is acked: the processing that follows must not end with it.
		ctx = context.WithoutCancel(ctx)
	}

	md, convErr := h.conv.FromMessage(h.topic, msg)
	var err error
	if convErr != nil {
		err = h.reject.Process(context.WithValue(ctx, convErrKey{}, convErr), md)
	} else {
		err = h.chain.Process(ctx, md)
	}

	outcome := processor.OutcomeOf(err)
	if !h.ackOnReceipt {
		h.settle(ctx, msg, md, st, outcome)
	}
	h.log(md, st, outcome, err)
	if st.Span != nil {
		st.Span.End() // last: the delivery's ack, metrics and log are done
	}
	return nil
}

func (h *handler) log(md *messagedata.MessageData, st *delivery.State, outcome processor.Outcome, err error) {
	attempt := st.Retries + 1
	switch outcome {
	case processor.Processed, processor.Duplicate:
		if h.logger.Enabled(context.Background(), slog.LevelDebug) {
			h.logger.Debug("message "+string(outcome), "message_id", md.ID, "attempt", attempt)
		}
	case processor.DeadLettered:
		h.logger.Warn("message dead-lettered", "message_id", md.ID, "attempt", attempt, "reason", err)
	case processor.Panicked:
		var p *processor.PanicError
		errors.As(err, &p)
		h.logger.Error("processor panicked; rolled back, message nacked", "message_id", md.ID, "attempt", attempt,
			"panic", fmt.Sprint(p.Value), "stack", string(p.Stack))
	default:
		level := slog.LevelWarn
		if h.ackOnReceipt {
			level = slog.LevelError // the message is acked already: its effect is lost
		}
		h.logger.Log(context.Background(), level, "message processing failed", "message_id", md.ID, "attempt", attempt,
			"error", err, "lost", h.ackOnReceipt)
	}
}

func wrap(mws []middleware.Middleware, p processor.Processor) processor.Processor {
	for i := len(mws) - 1; i >= 0; i-- {
		p = mws[i](p)
	}
	return p
}

// gate counts deliveries in flight and refuses new ones once closing.
type gate struct {
	mu      sync.Mutex
	n       int
	closing bool
	idle    chan struct{}
}

func (g *gate) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closing {
		return false
	}
	g.n++
	return true
}

func (g *gate) leave() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.n--
	if g.closing && g.n == 0 {
		close(g.idle)
	}
}

// close refuses new deliveries and returns a channel closed when none is in flight.
func (g *gate) close() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closing {
		g.closing = true
		if g.n == 0 {
			close(g.idle)
		}
	}
	return g.idle
}

// onceClosingSubscriber lets the watermill router close one subscriber from each of the
// handler's subscriptions: only the first Close reaches it.
type onceClosingSubscriber struct {
	message.Subscriber
	once sync.Once
	err  error
}

func (s *onceClosingSubscriber) Close() error {
	s.once.Do(func() { s.err = s.Subscriber.Close() })
	return s.err
}
