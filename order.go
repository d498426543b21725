package onceflow

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// OrderConfig configures per-key ordering for a handler: the "in-order" interceptor of
// ExactlyOnceInOrder (package ordering). The zero value is valid.
type OrderConfig struct {
	// GapTimeout is how long a key may wait for its next message (missing, or parked and
	// failing) before GapPolicy applies. Defaults to ordering.DefaultGapTimeout (5 min). It
	// should exceed the longest time the broker takes to redeliver a message.
	GapTimeout time.Duration

	// GapPolicy is what happens to a key whose wait passed GapTimeout: ordering.Wait (the
	// default) keeps waiting, ordering.Skip gives up on the missing sequences and applies what
	// follows, ordering.DeadLetter moves the key's parked messages to the dead-letter topic.
	// The timeout is logged and counted in onceflow.order.gap_timeouts whatever the policy.
	GapPolicy ordering.GapPolicy

	// SweepInterval is how often the router's sweeper retries stalled keys and looks for
	// timed-out gaps. Defaults to ordering.DefaultSweepInterval (10 s), or GapTimeout/2 when
	// shorter. A negative value starts no sweeper: call ordering.InOrder.Sweep yourself.
	SweepInterval time.Duration

	// MaxDrain bounds how many parked messages the transaction of the message that fills their
	// gap applies; the sweeper releases the rest. Defaults to ordering.DefaultMaxDrain (1000).
	MaxDrain int

	// AllowUnkeyed processes messages without an ordering key and sequence exactly once, in no
	// particular order. Defaults to false: they are dead-lettered.
	AllowUnkeyed bool

	// Table is the prefix of the ordering tables. Defaults to ordering.DefaultTable
	// (onceflow_order_state, _parked, _skipped). Handlers may share them.
	Table string
}

func (c OrderConfig) validate(handler string) error {
	switch {
	case c.GapTimeout < 0:
		return fmt.Errorf("Handler.Order.GapTimeout: %s is negative (handler %q)", c.GapTimeout, handler)
	case c.MaxDrain < 0:
		return fmt.Errorf("Handler.Order.MaxDrain: %d is negative (handler %q)", c.MaxDrain, handler)
	case c.GapPolicy < ordering.Wait || c.GapPolicy > ordering.DeadLetter:
		return fmt.Errorf("Handler.Order.GapPolicy: %s is not a gap policy (handler %q; want ordering.Wait, Skip or DeadLetter)", c.GapPolicy, handler)
	}
	if err := (ordering.StoreConfig{Table: c.Table}).Validate(); err != nil {
		return fmt.Errorf("Handler.Order.%w", err)
	}
	return nil
}

// orderRegistry holds the ordering stores and interceptors of the router's handlers.
type orderRegistry struct {
	mu     sync.Mutex
	stores map[storeKey]*ordering.Store
	list   []*ordering.InOrder
	sweep  map[*ordering.InOrder]bool
}

func (o *orderRegistry) store(db *sqldb.DB, table string) (*ordering.Store, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	key := storeKey{db: db, table: table}
	if s, ok := o.stores[key]; ok {
		return s, nil
	}
	s, err := ordering.NewStore(db, ordering.StoreConfig{Table: table})
	if err != nil {
		return nil, err
	}
	if o.stores == nil {
		o.stores = map[storeKey]*ordering.Store{}
	}
	o.stores[key] = s
	return s, nil
}

func (o *orderRegistry) add(io *ordering.InOrder, sweep bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.list = append(o.list, io)
	if o.sweep == nil {
		o.sweep = map[*ordering.InOrder]bool{}
	}
	o.sweep[io] = sweep
}

func (o *orderRegistry) all() []*ordering.InOrder {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]*ordering.InOrder(nil), o.list...)
}

func (o *orderRegistry) migrate(ctx context.Context) error {
	o.mu.Lock()
	stores := make([]*ordering.Store, 0, len(o.stores))
	for _, s := range o.stores {
		stores = append(stores, s)
	}
	o.mu.Unlock()
	for _, s := range stores {
		if err := s.Migrate(ctx); err != nil {
			return err
		}
	}
	return nil
}

// inOrder is the factory of the "in-order" interceptor.
func (r *Router) inOrder(h HandlerInfo) (middleware.Middleware, error) {
	cfg := h.Handler.Order
	store, err := r.orders.store(h.DB, cfg.Table)
	if err != nil {
		return nil, fmt.Errorf("Handler.Order: %w", err)
	}
	io, err := ordering.New(store, ordering.Config{
		Handler:             h.Name,
		GapTimeout:          cfg.GapTimeout,
		GapPolicy:           cfg.GapPolicy,
		SweepInterval:       max(cfg.SweepInterval, 0),
		MaxDrain:            cfg.MaxDrain,
		AllowUnkeyed:        cfg.AllowUnkeyed,
		DeadLetterPublisher: r.cfg.DeadLetterPublisher,
		DeadLetterTopic:     r.cfg.DeadLetterTopic,
		Forget:              forgetter(h),
		Logger:              r.logger,
		MeterProvider:       r.cfg.MeterProvider,
	})
	if err != nil {
		return nil, fmt.Errorf("Handler.Order: %w", err)
	}
	mw := io.Middleware()
	// Registered once it wraps the handler's processor: only then can its sweeper run.
	return func(next processor.Processor) processor.Processor {
		r.orders.add(io, cfg.SweepInterval >= 0)
		return mw(next)
	}, nil
}

// forgetter returns the function that deletes a message's record from the handler's dedup
// store, when the store can (as *dedup.SQLStore can), with the key the handler records.
func forgetter(h HandlerInfo) func(context.Context, sqlx.ExtContext, *messagedata.MessageData) error {
	store, ok := h.Dedup.(interface {
		Forget(ctx context.Context, tx sqlx.ExtContext, key dedup.Key) error
	})
	if !ok {
		return nil
	}
	withTimestamp := h.Handler.Dedup.WithTimestamp
	return func(ctx context.Context, tx sqlx.ExtContext, msg *messagedata.MessageData) error {
		key := dedup.Key{Handler: h.Name, MessageID: msg.ID}
		if withTimestamp && !msg.Timestamp.IsZero() {
			key.Timestamp = msg.Timestamp.UnixMicro()
		}
		return store.Forget(ctx, tx, key)
	}
}

// startOrdering starts the sweeper of every in-order handler and registers the
// onceflow.order.parked gauge. stop ends the sweepers, waits for them, and unregisters the
// gauge.
func (r *Router) startOrdering(ctx context.Context) (stop func(), err error) {
	ios := r.orders.all()
	if len(ios) == 0 {
		return func() {}, nil
	}
	mp := r.cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := telemetry.Meter(mp)
	parked, err := meter.Int64ObservableGauge(telemetry.MetricOrderParked, metric.WithUnit("{message}"),
		metric.WithDescription("Messages parked because they arrived before one of their predecessors (ExactlyOnceInOrder); a key whose messages stay parked waits for a gap to fill."))
	if err != nil {
		return nil, fmt.Errorf("create the parked messages gauge: %w", err)
	}
	reg, err := meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		for _, io := range ios {
			st, err := io.Stats(ctx)
			if err != nil {
				r.logger.Warn("cannot read the ordering state for its gauge", "handler", io.Handler(), "error", err)
				continue
			}
			o.ObserveInt64(parked, st.Parked, metric.WithAttributeSet(attribute.NewSet(telemetry.AttrHandler.String(io.Handler()))))
		}
		return nil
	}, parked)
	if err != nil {
		return nil, fmt.Errorf("register the parked messages gauge: %w", err)
	}

	sweepCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	r.orders.mu.Lock()
	for _, io := range ios {
		if r.orders.sweep[io] {
			wg.Go(func() { _ = io.Run(sweepCtx) })
		}
	}
	r.orders.mu.Unlock()
	return func() {
		cancel()
		wg.Wait()
		_ = reg.Unregister()
	}, nil
}
