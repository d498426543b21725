package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/groupcommit"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file resolves a handler's chain (which implementation each built-in stage takes, by the
// Handler's configuration) and builds its middlewares: the builders of the built-in stages of
// the table builtins (chain.go), each from the Handler and the router's Config.

// plan is a handler's chain resolved: the implementation each of its built-in stages takes.
type plan struct {
	chain Chain
	// group: the built-in transaction runs groups (group commit, or a batch processor).
	group bool
	// hasDedup: the chain holds the built-in deduplicate stage, which detects duplicates in
	// mode dedup.
	hasDedup bool
	dedup    middleware.DedupMode
	// deadLetter: the chain holds the built-in dead-letter stage, which applies the delivery
	// limit.
	deadLetter bool
	// recordsKeys: a built-in stage records message ids in the handler's dedup store, which
	// the router creates for it.
	recordsKeys bool
}

// planOf resolves the chain of h.
func planOf(h Handler) plan {
	c := h.chain()
	p := plan{chain: c, deadLetter: c.builtin(StageDeadLetter) != nil}
	p.hasDedup, p.dedup = c.builtin(StageDeduplicate) != nil, h.Dedup.Mode
	// Group commit is the default; DedupCheckFirst, which records internal ids one by one,
	// keeps a transaction per message.
	p.group = c.builtin(StageTransaction) != nil &&
		(h.BatchProcessor != nil || !h.GroupCommit.Disabled && !(p.hasDedup && p.dedup == middleware.DedupCheckFirst))
	p.recordsKeys = p.hasDedup && p.dedup.RecordsIDs() || c.builtin(StageInOrder) != nil
	return p
}

// byOffset reports whether the chain detects duplicates by offset; windowed, whether its
// groups take a partition's messages several at once.
func (p plan) byOffset() (byOffset, windowed bool) {
	byOffset = p.hasDedup && p.dedup == middleware.DedupByOffset
	return byOffset, byOffset && p.group
}

// stageEnv is what the builders of a handler's stages know of it.
type stageEnv struct {
	HandlerInfo
	plan plan
}

// handlerInfo is what the stages of h's chain know of it, whose dedup store is store and whose
// log lines go to logger.
func handlerInfo(h Handler, store dedup.Store, logger *slog.Logger) HandlerInfo {
	system, group := describeBroker(h)
	return HandlerInfo{
		Name:            h.Name,
		Topic:           h.Topic,
		DB:              h.DB,
		Dedup:           store,
		Logger:          logger.With("handler", h.Name),
		Handler:         h,
		MessagingSystem: system,
		ConsumerGroup:   group,
	}
}

// chains are the two chains of a handler, and its lane.
type chains struct {
	// chain is the one its messages go through; reject the one of a message that cannot be
	// converted.
	chain, reject processor.Processor
	// lane runs its first deliveries without a goroutine each, when its chain allows (nil
	// otherwise).
	lane *lane
}

// buildChains builds the two chains of the handler of env, and its lane.
func buildChains(r *Router, env *stageEnv) (chains, error) {
	links, err := buildLinks(r, env, env.plan.chain)
	if err != nil {
		return chains{}, err
	}
	// The onceflow.process span is innermost: one per attempt, around the user's processor only.
	var inner processor.Processor = batchOnly{}
	if env.Handler.Processor != nil {
		inner = traceProcessor(env.Handler.Processor)
	}
	out := chains{chain: compose(links, inner), lane: newLane(env.Handler, links, inner)}

	// A message that cannot be converted goes through the stages that observe the delivery,
	// to a processor that fails permanently with the conversion error: it is traced, counted
	// and dead-lettered like any other permanent failure.
	rejectLinks, err := buildLinks(r, env, rejectChain(env.plan.chain))
	if err != nil {
		return chains{}, err
	}
	out.reject = compose(rejectLinks, processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
		return processor.Permanent(ctx.Value(convErrKey{}).(error))
	}))
	return out, nil
}

// link is one stage of a built chain.
type link struct {
	name StageName
	mw   middleware.Middleware
	// observer is the observer mw is made of; nil for any other.
	observer middleware.Observer
	lane     laneRole
}

// buildLinks builds the middlewares of the stages of c for the handler of env, outermost first.
// A stage that takes no part in the handler's chain has no link.
func buildLinks(r *Router, env *stageEnv, c Chain) ([]link, error) {
	var links []link
	for _, s := range c.stages {
		l := link{name: s.name}
		var err error
		switch b := s.b; {
		case b != nil && b.observer != nil:
			l.observer, err = b.observer(r, env)
			l.lane = b.lane
		case b != nil:
			l.mw, err = b.build(r, env)
			l.lane = b.lane
			if b.name == StageTransaction && env.plan.group {
				l.lane = laneJoin
			}
		case s.observer != nil:
			l.observer, l.lane = s.observer, laneObserve
		case s.factory != nil:
			l.mw, err = s.factory(env.HandlerInfo)
		default:
			l.mw = s.mw
		}
		if err != nil {
			return nil, fmt.Errorf("stage %s of handler %q: %w", s.name, env.Name, err)
		}
		if l.observer != nil {
			l.mw = middleware.Observe(l.observer)
		}
		if l.mw != nil {
			links = append(links, l)
		}
	}
	return links, nil
}

// batchOnly is the innermost processor of a handler with a BatchProcessor: the group
// transaction hands the messages to the batch processor and never calls it.
type batchOnly struct{}

func (batchOnly) Process(context.Context, *messagedata.MessageData) error {
	return errors.New("onceflow: a handler with a BatchProcessor reached its per-message processor (nothing may stand after the transaction stage)")
}

// compose returns p wrapped in the middlewares of links, the first outermost.
func compose(links []link, p processor.Processor) processor.Processor {
	if len(links) == 0 {
		return p
	}
	mws := make([]middleware.Middleware, len(links))
	for i, l := range links {
		mws[i] = l.mw
	}
	return middleware.Chain(mws[0], mws[1:]...)(p)
}

func newTracing(r *Router, e *stageEnv) (middleware.Observer, error) {
	t := middleware.Tracing{TracerProvider: r.cfg.TracerProvider, Propagator: r.cfg.Propagator,
		MessagingSystem: e.MessagingSystem, ConsumerGroup: e.ConsumerGroup}
	return t.Observer(e.Name), nil
}

func newMetrics(r *Router, e *stageEnv) (middleware.Observer, error) {
	m := middleware.Metrics{MeterProvider: r.cfg.MeterProvider, MessagingSystem: e.MessagingSystem, ConsumerGroup: e.ConsumerGroup}
	return m.Observer(e.Name)
}

func newDeadLetter(r *Router, e *stageEnv) (middleware.Middleware, error) {
	return e.Handler.DeadLetter.Middleware(r.cfg.DeadLetterPublisher, r.cfg.DeadLetterTopic, e.Name)
}

func newRecover(*Router, *stageEnv) (middleware.Middleware, error) { return middleware.Recover(), nil }

func newRetry(_ *Router, e *stageEnv) (middleware.Middleware, error) {
	return e.Handler.Retry.Middleware()
}

func newTimeout(_ *Router, e *stageEnv) (middleware.Middleware, error) {
	if e.Handler.Timeout == 0 {
		return nil, nil
	}
	return middleware.Timeout(e.Handler.Timeout), nil
}

// newTransaction builds the transaction: one per message, or with group commit one per group,
// which records the ids (or the offsets) of its messages itself when the chain detects
// duplicates that way.
func newTransaction(r *Router, e *stageEnv) (middleware.Middleware, error) {
	h := e.Handler
	if !e.plan.group {
		return h.Transaction.Middleware(middleware.Pool(e.DB)), nil
	}
	sizes, attrs := r.instruments.GroupSize, metric.WithAttributeSet(attribute.NewSet(telemetry.AttrHandler.String(h.Name)))
	cfg := groupcommit.Config{
		DB:          middleware.Pool(e.DB),
		Isolation:   h.Transaction.Isolation,
		MaxSize:     h.GroupCommit.MaxSize,
		MaxWait:     h.GroupCommit.MaxWait,
		Concurrency: max(h.Concurrency, 1),
		Batch:       h.BatchProcessor,
		Handler:     h.Name,
		Committed:   func(ctx context.Context, messages int) { sizes.Record(ctx, int64(messages), attrs) },
	}
	if byOffset, _ := e.plan.byOffset(); byOffset {
		p, err := r.positionsFor(h)
		if err != nil {
			return nil, err
		}
		cfg.Positions = p
	} else if e.plan.hasDedup && e.plan.dedup == middleware.DedupInsertFirst {
		store, ok := e.Dedup.(groupcommit.Store)
		if !ok {
			return nil, fmt.Errorf("Handler.Dedup.Store: %T cannot record a group's ids (group commit needs RecordMany and Forget, as *dedup.SQLStore has)", e.Dedup)
		}
		cfg.Store, cfg.WithTimestamp = store, h.Dedup.WithTimestamp
		cfg.BeyondRetention, cfg.ReportBeyond = h.Dedup.BeyondRetention, r.beyondRetention(e)
	}
	return groupcommit.New(cfg)
}

// newDeduplicate builds duplicate detection in the mode of the handler's Dedup, in the
// handler's dedup store; under group commit, the group's transaction records ids and offsets
// itself.
func newDeduplicate(_ *Router, e *stageEnv) (middleware.Middleware, error) {
	h, d := e.Handler, e.Handler.Dedup
	switch {
	case e.plan.group && (d.Mode == middleware.DedupInsertFirst || d.Mode == middleware.DedupByOffset):
		return nil, nil
	case d.Mode == middleware.DedupAckInTransaction:
		if a, ok := h.Subscriber.(interface{ AcksInTransaction() bool }); !ok || !a.AcksInTransaction() {
			return nil, fmt.Errorf("Handler.Subscriber: %T cannot acknowledge a message in the handler's transaction (Handler.Dedup.Mode DedupAckInTransaction needs the PostgreSQL or MySQL queue of the handler's database)",
				h.Subscriber)
		}
	case d.Mode.RecordsIDs():
		d.Store = e.Dedup
	}
	return d.Middleware(e.DB, e.Name)
}

// beyondRetention returns the report of a message of env's handler delivered beyond its dedup
// retention: a count and a log line.
func (r *Router) beyondRetention(e *stageEnv) func(ctx context.Context, msg *messagedata.MessageData, reason string) {
	policy := e.Handler.Dedup.BeyondRetention
	return func(ctx context.Context, msg *messagedata.MessageData, reason string) {
		r.instruments.BeyondRetention.Add(ctx, 1, metric.WithAttributes(telemetry.AttrHandler.String(e.Name), telemetry.AttrReason.String(reason)))
		e.Logger.Warn("message delivered beyond the dedup retention", "message_id", msg.ID, "reason", reason,
			"policy", policy.String(), "delivery", msg.Delivery)
	}
}
