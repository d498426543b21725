package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file resolves a handler's chain (which implementation each built-in stage takes, by the
// Handler's configuration) and builds its middlewares: the builders of the built-in stages of
// the table builtins (chain.go), each from the Handler and the router's Config.

// dedupMode is how a handler's deduplicate stage detects duplicates.
type dedupMode int

const (
	// dedupNone: the chain holds no built-in deduplicate stage.
	dedupNone dedupMode = iota
	dedupByID
	dedupCheckFirst
	dedupByOffset
	dedupAckInTx
	dedupNatural
)

// plan is a handler's chain resolved: the implementation each of its built-in stages takes.
type plan struct {
	chain Chain
	// group: the built-in transaction runs groups (group commit, or a batch processor).
	group bool
	// dedup is the mode of the built-in deduplicate stage.
	dedup dedupMode
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
	p.group = c.builtin(StageTransaction) != nil && (h.GroupCommit.Enabled || h.BatchProcessor != nil)
	if c.builtin(StageDeduplicate) != nil {
		switch d := h.Dedup; {
		case d.ByOffset:
			p.dedup = dedupByOffset
		case d.AckInTransaction:
			p.dedup = dedupAckInTx
		case len(d.UniqueConstraints) > 0:
			p.dedup = dedupNatural
		case d.CheckFirst:
			p.dedup = dedupCheckFirst
		default:
			p.dedup = dedupByID
		}
	}
	p.recordsKeys = p.dedup == dedupByID || p.dedup == dedupCheckFirst || c.builtin(StageInOrder) != nil
	return p
}

// byOffset reports whether the chain detects duplicates by offset; windowed, whether its
// groups take a partition's messages several at once.
func (p plan) byOffset() (byOffset, windowed bool) {
	return p.dedup == dedupByOffset, p.dedup == dedupByOffset && p.group
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
	opts := []middleware.TracingOption{}
	if r.cfg.TracerProvider != nil {
		opts = append(opts, middleware.WithTracerProvider(r.cfg.TracerProvider))
	}
	if r.cfg.Propagator != nil {
		opts = append(opts, middleware.WithPropagator(r.cfg.Propagator))
	}
	opts = append(opts, middleware.WithMessagingSystem(e.MessagingSystem))
	if e.ConsumerGroup != "" {
		opts = append(opts, middleware.WithConsumerGroup(e.ConsumerGroup))
	}
	return middleware.TracingObserver(e.Name, opts...), nil
}

func newMetrics(r *Router, e *stageEnv) (middleware.Observer, error) {
	opts := []middleware.MetricsOption{middleware.WithMessagingSystem(e.MessagingSystem)}
	if e.ConsumerGroup != "" {
		opts = append(opts, middleware.WithConsumerGroup(e.ConsumerGroup))
	}
	if r.cfg.MeterProvider != nil {
		opts = append(opts, middleware.WithMeterProvider(r.cfg.MeterProvider))
	}
	return middleware.MetricsObserver(e.Name, opts...)
}

func newDeadLetter(r *Router, e *stageEnv) (middleware.Middleware, error) {
	var opts []middleware.DeadLetterOption
	h := e.Handler
	if limit := h.MaxDeliveries; limit >= 0 && h.qos() != BestEffort {
		if limit == 0 {
			limit = DefaultMaxDeliveries
		}
		opts = append(opts, middleware.WithMaxDeliveries(limit))
		if store, db := e.Dedup, e.DB; store != nil && db != nil {
			opts = append(opts, middleware.WithProcessedCheck(func(ctx context.Context, msg *messagedata.MessageData) (bool, error) {
				_, found, err := store.Lookup(ctx, db, dedup.Key{Handler: e.Name, MessageID: msg.ID})
				return found, err
			}))
		}
	}
	if h.qos() != BestEffort {
		counter, err := r.counterFor(h)
		if err != nil {
			return nil, err
		}
		rec := deadLetterRecord{counter: counter, handler: e.Name}
		opts = append(opts, middleware.WithDeadLetterRecord(rec))
		if e.Dedup == nil && h.MaxDeliveries >= 0 {
			// No duplicate detection to ask whether a message over the limit was
			// processed: the counter remembers the redeliveries that were.
			opts = append(opts, middleware.WithProcessedCheck(rec.Processed), middleware.WithProcessedMark(rec.MarkProcessed))
		}
	}
	return middleware.DeadLetter(r.cfg.DeadLetterPublisher, r.cfg.DeadLetterTopic, e.Name, opts...)
}

func newRecover(*Router, *stageEnv) (middleware.Middleware, error) { return middleware.Recover(), nil }

func newRetry(_ *Router, e *stageEnv) (middleware.Middleware, error) {
	rc := e.Handler.Retry
	opts := []middleware.RetryOption{}
	if e.Handler.Classifier != nil {
		opts = append(opts, middleware.WithClassifier(e.Handler.Classifier))
	}
	if rc.MaxAttempts > 0 {
		opts = append(opts, middleware.WithMaxAttempts(rc.MaxAttempts))
	}
	if rc.InitialInterval > 0 || rc.MaxInterval > 0 {
		initial, maxI := rc.InitialInterval, rc.MaxInterval
		if initial == 0 {
			initial = middleware.DefaultRetryInitialInterval
		}
		if maxI == 0 {
			maxI = max(initial, middleware.DefaultRetryMaxInterval)
		}
		opts = append(opts, middleware.WithBackoff(initial, maxI))
	}
	return middleware.Retry(opts...)
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
	if !e.plan.group {
		var opts []middleware.TxOption
		if e.Handler.Isolation != 0 {
			opts = append(opts, middleware.WithIsolation(e.Handler.Isolation))
		}
		return middleware.Transaction(middleware.Pool(e.DB), opts...), nil
	}
	switch e.plan.dedup {
	case dedupByID:
		store, ok := e.Dedup.(middleware.GroupStore)
		if !ok {
			return nil, fmt.Errorf("Handler.Dedup.Store: %T cannot record a group's ids (group commit needs RecordMany and Forget, as *dedup.SQLStore has)", e.Dedup)
		}
		opts := append(groupOptions(r, e.Handler), retentionPolicy(r, e))
		if e.Handler.Dedup.WithTimestamp {
			opts = append(opts, middleware.WithTimestampKey())
		}
		return middleware.GroupCommit(middleware.Pool(e.DB), store, e.Name, opts...)
	case dedupByOffset:
		p, err := r.positionsFor(e.Handler)
		if err != nil {
			return nil, err
		}
		return middleware.GroupOffsets(middleware.Pool(e.DB), p, e.Name, groupOptions(r, e.Handler)...)
	}
	return middleware.GroupTransaction(middleware.Pool(e.DB), groupOptions(r, e.Handler)...)
}

// newDeduplicate builds duplicate detection in the mode of the handler's Dedup; under group
// commit, the group's transaction records ids and offsets itself.
func newDeduplicate(r *Router, e *stageEnv) (middleware.Middleware, error) {
	h := e.Handler
	switch e.plan.dedup {
	case dedupByID, dedupCheckFirst:
		if e.plan.group {
			return nil, nil
		}
		opts := []middleware.DedupOption{retentionPolicy(r, e)}
		if h.Dedup.WithTimestamp {
			opts = append(opts, middleware.WithTimestampKey())
		}
		if e.plan.dedup == dedupCheckFirst {
			opts = append(opts, middleware.CheckFirst())
		}
		return middleware.Deduplicate(e.Dedup, e.Name, opts...)
	case dedupByOffset:
		if e.plan.group {
			return nil, nil
		}
		p, err := r.positionsFor(h)
		if err != nil {
			return nil, err
		}
		return middleware.Offsets(p, e.Name), nil
	case dedupAckInTx:
		if a, ok := h.Subscriber.(interface{ AcksInTransaction() bool }); !ok || !a.AcksInTransaction() {
			return nil, fmt.Errorf("Handler.Subscriber: %T cannot acknowledge a message in the handler's transaction (Handler.Dedup.AckInTransaction needs the PostgreSQL or MySQL queue of the handler's database)",
				h.Subscriber)
		}
		return middleware.AckInTransaction(), nil
	case dedupNatural:
		names := h.Dedup.UniqueConstraints
		return middleware.NaturalIdempotency(names[0], names[1:]...), nil
	}
	return nil, nil
}

// retentionPolicy is the retention option of the duplicate detection of env's handler: its
// policy, and a report that counts and logs each message delivered beyond the retention.
func retentionPolicy(r *Router, e *stageEnv) middleware.DedupOption {
	attrs := func(reason string) metric.AddOption {
		return metric.WithAttributes(telemetry.AttrHandler.String(e.Name), telemetry.AttrReason.String(reason))
	}
	policy := e.Handler.Dedup.BeyondRetention
	return middleware.WithRetentionPolicy(policy, func(ctx context.Context, msg *messagedata.MessageData, reason string) {
		r.instruments.BeyondRetention.Add(ctx, 1, attrs(reason))
		e.Logger.Warn("message delivered beyond the dedup retention", "message_id", msg.ID, "reason", reason,
			"policy", policy.String(), "delivery", msg.Delivery)
	})
}

// groupOptions are the options of a group transaction for h, which records the size of each
// group it commits in r's group-size histogram.
func groupOptions(r *Router, h Handler) []middleware.GroupOption {
	sizes, attrs := r.instruments.GroupSize, metric.WithAttributeSet(attribute.NewSet(telemetry.AttrHandler.String(h.Name)))
	opts := []middleware.GroupOption{
		middleware.WithConcurrency(max(h.Concurrency, 1)),
		middleware.WithCommitted(func(ctx context.Context, messages int) { sizes.Record(ctx, int64(messages), attrs) }),
	}
	if h.GroupCommit.MaxSize > 0 {
		opts = append(opts, middleware.WithMaxGroupSize(h.GroupCommit.MaxSize))
	}
	if h.GroupCommit.MaxWait > 0 {
		opts = append(opts, middleware.WithMaxWait(h.GroupCommit.MaxWait))
	}
	if h.Isolation != 0 {
		opts = append(opts, middleware.WithIsolation(h.Isolation))
	}
	if h.BatchProcessor != nil {
		opts = append(opts, middleware.WithBatch(h.BatchProcessor))
	}
	return opts
}
