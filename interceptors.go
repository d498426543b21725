package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/sqldb"
)

// Names of the built-in interceptors, for Handler.Interceptors.
const (
	InterceptorTracing            = "tracing"
	InterceptorMetrics            = "metrics"
	InterceptorDeadLetter         = "deadletter"
	InterceptorRecover            = "recover"
	InterceptorRetry              = "retry"
	InterceptorTimeout            = "timeout"
	InterceptorTransaction        = "transaction"
	InterceptorDeduplicate        = "deduplicate"
	InterceptorNaturalIdempotency = "natural-idempotency"
	InterceptorOffsets            = "offsets"
	InterceptorAckInTransaction   = "ack-in-transaction"
	InterceptorInOrder            = "in-order"
	// InterceptorGroupCommit processes concurrent deliveries in one transaction and records
	// their ids in it (middleware.GroupCommit): it takes the place of "transaction" and
	// "deduplicate".
	InterceptorGroupCommit = "group-commit"
	// InterceptorGroupTransaction is group commit without duplicate detection
	// (middleware.GroupTransaction): it takes the place of "transaction".
	InterceptorGroupTransaction = "group-transaction"
)

// HandlerInfo is what an InterceptorFactory knows of the handler it builds a middleware for.
type HandlerInfo struct {
	// Name and Topic of the handler.
	Name, Topic string
	// DB is the handler's database.
	DB *sqldb.DB
	// Dedup is the handler's duplicate-detection store.
	Dedup dedup.Store
	// Logger is the router's logger, with the handler name attached.
	Logger *slog.Logger
	// MessagingSystem and ConsumerGroup describe the broker for telemetry: the OpenTelemetry
	// messaging.system and messaging.consumer.group.name (see Handler.MessagingSystem).
	MessagingSystem, ConsumerGroup string
	// Handler is the whole handler configuration.
	Handler Handler
}

// InterceptorFactory builds the middleware an interceptor name stands for, for one handler.
type InterceptorFactory func(h HandlerInfo) (middleware.Middleware, error)

// chainFor returns the interceptor names of the canonical chain for q, outermost first; with
// group, group commit takes the place of "transaction" and "deduplicate".
//
// Middlewares run in the order given: the first is the outermost, so it sees the message first
// and the outcome last.
func chainFor(q QoS, group bool) []string {
	names := qosChain(q)
	if !group {
		return names
	}
	out := make([]string, 0, len(names))
	for _, n := range names {
		switch n {
		case InterceptorTransaction:
			if slices.Contains(names, InterceptorDeduplicate) {
				out = append(out, InterceptorGroupCommit)
			} else {
				out = append(out, InterceptorGroupTransaction)
			}
		case InterceptorDeduplicate:
		default:
			out = append(out, n)
		}
	}
	return out
}

func qosChain(q QoS) []string {
	switch q {
	case BestEffort:
		return []string{InterceptorTracing, InterceptorMetrics, InterceptorRecover, InterceptorTimeout, InterceptorTransaction}
	case AtLeastOnce:
		return []string{InterceptorTracing, InterceptorMetrics, InterceptorDeadLetter, InterceptorRecover, InterceptorRetry,
			InterceptorTimeout, InterceptorTransaction}
	case ExactlyOnce:
		return []string{InterceptorTracing, InterceptorMetrics, InterceptorDeadLetter, InterceptorRecover, InterceptorRetry,
			InterceptorTimeout, InterceptorTransaction, InterceptorDeduplicate}
	case ExactlyOnceInOrder:
		return []string{InterceptorTracing, InterceptorMetrics, InterceptorDeadLetter, InterceptorRecover, InterceptorRetry,
			InterceptorTimeout, InterceptorTransaction, InterceptorDeduplicate, InterceptorInOrder}
	}
	return nil
}

// recordsKeys reports whether a chain records message ids in a dedup store.
func recordsKeys(names []string) bool {
	for _, n := range names {
		if n == InterceptorDeduplicate || n == InterceptorInOrder || n == InterceptorGroupCommit {
			return true
		}
	}
	return false
}

// checkOrder enforces the two rules every chain keeps: Retry outside Transaction, so each
// attempt gets a fresh transaction, and the interceptors that write through the transaction
// inside it. A group-commit interceptor stands for the transaction, and owns duplicate
// detection: it does not go with "transaction" or "deduplicate".
func checkOrder(names []string) error {
	pos := map[string]int{}
	for i, n := range names {
		if _, dup := pos[n]; dup {
			return fmt.Errorf("Handler.Interceptors: %q appears twice", n)
		}
		pos[n] = i
	}
	txName := InterceptorTransaction
	for _, group := range []string{InterceptorGroupCommit, InterceptorGroupTransaction} {
		if _, ok := pos[group]; !ok {
			continue
		}
		for _, other := range []string{InterceptorTransaction, InterceptorDeduplicate, InterceptorOffsets, InterceptorAckInTransaction, InterceptorGroupCommit, InterceptorGroupTransaction} {
			if _, ok := pos[other]; ok && other != group {
				return fmt.Errorf("Handler.Interceptors: %q cannot be combined with %q (group commit runs the transaction and records the message ids itself)", group, other)
			}
		}
		txName = group
	}
	tx, hasTx := pos[txName]
	for _, inner := range []string{InterceptorDeduplicate, InterceptorNaturalIdempotency, InterceptorOffsets, InterceptorAckInTransaction, InterceptorInOrder} {
		if i, ok := pos[inner]; ok && (!hasTx || i < tx) {
			return fmt.Errorf("Handler.Interceptors: %q must come after %q (it writes through the transaction)", inner, txName)
		}
	}
	if r, ok := pos[InterceptorRetry]; ok && hasTx && r > tx {
		return fmt.Errorf("Handler.Interceptors: %q must come before %q (each attempt needs a fresh transaction)", InterceptorRetry, txName)
	}
	return nil
}

func (r *Router) builtinInterceptors() map[string]InterceptorFactory {
	return map[string]InterceptorFactory{
		InterceptorTracing: func(h HandlerInfo) (middleware.Middleware, error) {
			opts := []middleware.TracingOption{}
			if r.cfg.TracerProvider != nil {
				opts = append(opts, middleware.WithTracerProvider(r.cfg.TracerProvider))
			}
			if r.cfg.Propagator != nil {
				opts = append(opts, middleware.WithPropagator(r.cfg.Propagator))
			}
			opts = append(opts, middleware.WithMessagingSystem(h.MessagingSystem))
			if h.ConsumerGroup != "" {
				opts = append(opts, middleware.WithConsumerGroup(h.ConsumerGroup))
			}
			return middleware.Tracing(h.Name, opts...), nil
		},
		InterceptorMetrics: func(h HandlerInfo) (middleware.Middleware, error) {
			opts := []middleware.MetricsOption{middleware.WithMessagingSystem(h.MessagingSystem)}
			if h.ConsumerGroup != "" {
				opts = append(opts, middleware.WithConsumerGroup(h.ConsumerGroup))
			}
			if r.cfg.MeterProvider != nil {
				opts = append(opts, middleware.WithMeterProvider(r.cfg.MeterProvider))
			}
			return middleware.Metrics(h.Name, opts...)
		},
		InterceptorDeadLetter: func(h HandlerInfo) (middleware.Middleware, error) {
			var opts []middleware.DeadLetterOption
			if limit := h.Handler.MaxDeliveries; limit >= 0 && h.Handler.QoS != BestEffort {
				if limit == 0 {
					limit = DefaultMaxDeliveries
				}
				opts = append(opts, middleware.WithMaxDeliveries(limit))
				if store, db := h.Dedup, h.DB; store != nil && db != nil {
					opts = append(opts, middleware.WithProcessedCheck(func(ctx context.Context, msg *messagedata.MessageData) (bool, error) {
						_, found, err := store.Lookup(ctx, db, dedup.Key{Handler: h.Name, MessageID: msg.ID})
						return found, err
					}))
				}
			}
			if h.Handler.QoS != BestEffort {
				counter, err := r.counterFor(h.Handler)
				if err != nil {
					return nil, err
				}
				rec := deadLetterRecord{counter: counter, handler: h.Name}
				opts = append(opts, middleware.WithDeadLetterRecord(rec))
				if h.Dedup == nil && h.Handler.MaxDeliveries >= 0 {
					// No duplicate detection to ask whether a message over the limit was
					// processed: the counter remembers the redeliveries that were.
					opts = append(opts, middleware.WithProcessedCheck(rec.Processed), middleware.WithProcessedMark(rec.MarkProcessed))
				}
			}
			return middleware.DeadLetter(r.cfg.DeadLetterPublisher, r.cfg.DeadLetterTopic, h.Name, opts...)
		},
		InterceptorRecover: func(HandlerInfo) (middleware.Middleware, error) { return middleware.Recover(), nil },
		InterceptorRetry: func(h HandlerInfo) (middleware.Middleware, error) {
			rc := h.Handler.Retry
			opts := []middleware.RetryOption{}
			if h.Handler.Classifier != nil {
				opts = append(opts, middleware.WithClassifier(h.Handler.Classifier))
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
		},
		InterceptorTimeout: func(h HandlerInfo) (middleware.Middleware, error) {
			if h.Handler.Timeout == 0 {
				return nil, nil
			}
			return middleware.Timeout(h.Handler.Timeout), nil
		},
		InterceptorTransaction: func(h HandlerInfo) (middleware.Middleware, error) {
			var opts []middleware.TxOption
			if h.Handler.Isolation != 0 {
				opts = append(opts, middleware.WithIsolation(h.Handler.Isolation))
			}
			return middleware.Transaction(middleware.Pool(h.DB), opts...), nil
		},
		InterceptorDeduplicate: func(h HandlerInfo) (middleware.Middleware, error) {
			opts := []middleware.DedupOption{r.retentionPolicy(h)}
			if h.Handler.Dedup.WithTimestamp {
				opts = append(opts, middleware.WithTimestampKey())
			}
			if h.Handler.Dedup.CheckFirst {
				opts = append(opts, middleware.CheckFirst())
			}
			return middleware.Deduplicate(h.Dedup, h.Name, opts...)
		},
		InterceptorNaturalIdempotency: func(h HandlerInfo) (middleware.Middleware, error) {
			names := h.Handler.Dedup.UniqueConstraints
			if len(names) == 0 {
				return nil, errors.New("Handler.Dedup.UniqueConstraints: empty (natural idempotency takes a unique violation for an earlier delivery of the message only on the constraints named here; any other is a conflict with another row)")
			}
			return middleware.NaturalIdempotency(names[0], names[1:]...), nil
		},
		InterceptorAckInTransaction: func(h HandlerInfo) (middleware.Middleware, error) {
			if a, ok := h.Handler.Subscriber.(interface{ AcksInTransaction() bool }); !ok || !a.AcksInTransaction() {
				return nil, fmt.Errorf("Handler.Subscriber: %T cannot acknowledge a message in the handler's transaction (%q needs the PostgreSQL or MySQL queue of the handler's database)",
					h.Handler.Subscriber, InterceptorAckInTransaction)
			}
			return middleware.AckInTransaction(), nil
		},
		InterceptorOffsets: func(h HandlerInfo) (middleware.Middleware, error) {
			p, err := r.positionsFor(h.Handler)
			if err != nil {
				return nil, err
			}
			return middleware.Offsets(p, h.Name), nil
		},
		InterceptorGroupCommit: func(h HandlerInfo) (middleware.Middleware, error) {
			if h.Handler.Dedup.CheckFirst {
				return nil, errors.New("Handler.Dedup.CheckFirst: not supported with group commit (a group records its ids with one multi-row insert, without internal ids)")
			}
			store, ok := h.Dedup.(middleware.GroupStore)
			if !ok {
				return nil, fmt.Errorf("Handler.Dedup.Store: %T cannot record a group's ids (group commit needs RecordMany and Forget, as *dedup.SQLStore has)", h.Dedup)
			}
			opts := append(groupOptions(h.Handler), r.retentionPolicy(h))
			if h.Handler.Dedup.WithTimestamp {
				opts = append(opts, middleware.WithTimestampKey())
			}
			return middleware.GroupCommit(middleware.Pool(h.DB), store, h.Name, opts...)
		},
		InterceptorGroupTransaction: func(h HandlerInfo) (middleware.Middleware, error) {
			return middleware.GroupTransaction(middleware.Pool(h.DB), groupOptions(h.Handler)...)
		},
		InterceptorInOrder: r.inOrder,
	}
}

// retentionPolicy is the retention option of h's duplicate detection: its policy, and a report
// that counts and logs each message delivered beyond the retention.
func (r *Router) retentionPolicy(h HandlerInfo) middleware.DedupOption {
	attrs := func(reason string) metric.AddOption {
		return metric.WithAttributes(telemetry.AttrHandler.String(h.Name), telemetry.AttrReason.String(reason))
	}
	return middleware.WithRetentionPolicy(h.Handler.Dedup.BeyondRetention, func(ctx context.Context, msg *messagedata.MessageData, reason string) {
		r.instruments.BeyondRetention.Add(ctx, 1, attrs(reason))
		h.Logger.Warn("message delivered beyond the dedup retention", "message_id", msg.ID, "reason", reason,
			"policy", h.Handler.Dedup.BeyondRetention.String(), "delivery", msg.Delivery)
	})
}

// groupOptions are the options of a group-commit interceptor for h.
func groupOptions(h Handler) []middleware.GroupOption {
	opts := []middleware.GroupOption{middleware.WithConcurrency(max(h.Concurrency, 1))}
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

// RegisterInterceptor makes a custom interceptor available to Handler.Interceptors under name.
// It must be called before the handlers that use it are added. A factory may return a nil
// middleware to take no part in a handler's chain.
func (r *Router) RegisterInterceptor(name string, f InterceptorFactory) error {
	if name == "" {
		return fmt.Errorf("RegisterInterceptor: empty name")
	}
	if f == nil {
		return fmt.Errorf("RegisterInterceptor %q: nil factory", name)
	}
	if _, exists := r.interceptors[name]; exists {
		return fmt.Errorf("RegisterInterceptor: %q is already registered", name)
	}
	r.interceptors[name] = f
	return nil
}

// buildChain builds the middlewares for names. outerOnly keeps only the interceptors that do not
// touch the database, for messages that cannot be converted.
func (r *Router) buildChain(info HandlerInfo, names []string) ([]middleware.Middleware, error) {
	var mws []middleware.Middleware
	for _, name := range names {
		f, ok := r.interceptors[name]
		if !ok {
			known := make([]string, 0, len(r.interceptors))
			for k := range r.interceptors {
				known = append(known, k)
			}
			slices.Sort(known)
			return nil, fmt.Errorf("Handler.Interceptors: unknown interceptor %q (known: %v)", name, known)
		}
		mw, err := f(info)
		if err != nil {
			return nil, fmt.Errorf("interceptor %q for handler %q: %w", name, info.Name, err)
		}
		if mw != nil {
			mws = append(mws, mw)
		}
	}
	return mws, nil
}
