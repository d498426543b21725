package onceflow

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

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

// newInOrder builds the in-order stage.
func newInOrder(r *Router, e *stageEnv) (middleware.Middleware, error) {
	h := e.HandlerInfo
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
		return store.Forget(ctx, tx, dedup.KeyOf(h.Name, msg, withTimestamp))
	}
}

// start starts the sweeper of every in-order handler and registers the onceflow.order.parked
// gauge on mp. stop ends the sweepers, waits for them, and unregisters the gauge.
func (o *orderRegistry) start(ctx context.Context, mp metric.MeterProvider, logger *slog.Logger) (stop func(), err error) {
	ios := o.all()
	if len(ios) == 0 {
		return func() {}, nil
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := telemetry.Meter(mp)
	parked, err := meter.Int64ObservableGauge(telemetry.MetricOrderParked, metric.WithUnit("{message}"),
		metric.WithDescription("Messages parked because they arrived before one of their predecessors (ExactlyOnceInOrder); a key whose messages stay parked waits for a gap to fill."))
	if err != nil {
		return nil, fmt.Errorf("create the parked messages gauge: %w", err)
	}
	reg, err := meter.RegisterCallback(func(ctx context.Context, obs metric.Observer) error {
		for _, io := range ios {
			st, err := io.Stats(ctx)
			if err != nil {
				logger.Warn("cannot read the ordering state for its gauge", "handler", io.Handler(), "error", err)
				continue
			}
			obs.ObserveInt64(parked, st.Parked, metric.WithAttributeSet(attribute.NewSet(telemetry.AttrHandler.String(io.Handler()))))
		}
		return nil
	}, parked)
	if err != nil {
		return nil, fmt.Errorf("register the parked messages gauge: %w", err)
	}

	sweepCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	o.mu.Lock()
	for _, io := range ios {
		if o.sweep[io] {
			wg.Go(func() { _ = io.Run(sweepCtx) })
		}
	}
	o.mu.Unlock()
	return func() {
		cancel()
		wg.Wait()
		_ = reg.Unregister()
	}, nil
}
