package onceflow

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
)

// This file holds the factories of the built-in interceptors (the table builtins in chain.go):
// each builds its middleware for one handler from the Handler and the router's Config.

func newTracing(r *Router, h HandlerInfo) (middleware.Observer, error) {
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
	return middleware.TracingObserver(h.Name, opts...), nil
}

func newMetrics(r *Router, h HandlerInfo) (middleware.Observer, error) {
	opts := []middleware.MetricsOption{middleware.WithMessagingSystem(h.MessagingSystem)}
	if h.ConsumerGroup != "" {
		opts = append(opts, middleware.WithConsumerGroup(h.ConsumerGroup))
	}
	if r.cfg.MeterProvider != nil {
		opts = append(opts, middleware.WithMeterProvider(r.cfg.MeterProvider))
	}
	return middleware.MetricsObserver(h.Name, opts...)
}

func newDeadLetter(r *Router, h HandlerInfo) (middleware.Middleware, error) {
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
}

func newRecover(_ *Router, _ HandlerInfo) (middleware.Middleware, error) {
	return middleware.Recover(), nil
}

func newRetry(_ *Router, h HandlerInfo) (middleware.Middleware, error) {
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
}

func newTimeout(_ *Router, h HandlerInfo) (middleware.Middleware, error) {
	if h.Handler.Timeout == 0 {
		return nil, nil
	}
	return middleware.Timeout(h.Handler.Timeout), nil
}

func newTransaction(_ *Router, h HandlerInfo) (middleware.Middleware, error) {
	var opts []middleware.TxOption
	if h.Handler.Isolation != 0 {
		opts = append(opts, middleware.WithIsolation(h.Handler.Isolation))
	}
	return middleware.Transaction(middleware.Pool(h.DB), opts...), nil
}

func newDeduplicate(r *Router, h HandlerInfo) (middleware.Middleware, error) {
	opts := []middleware.DedupOption{retentionPolicy(r, h)}
	if h.Handler.Dedup.WithTimestamp {
		opts = append(opts, middleware.WithTimestampKey())
	}
	if h.Handler.Dedup.CheckFirst {
		opts = append(opts, middleware.CheckFirst())
	}
	return middleware.Deduplicate(h.Dedup, h.Name, opts...)
}

func newNaturalIdempotency(_ *Router, h HandlerInfo) (middleware.Middleware, error) {
	names := h.Handler.Dedup.UniqueConstraints
	if len(names) == 0 {
		return nil, errors.New("Handler.Dedup.UniqueConstraints: empty (natural idempotency takes a unique violation for an earlier delivery of the message only on the constraints named here; any other is a conflict with another row)")
	}
	return middleware.NaturalIdempotency(names[0], names[1:]...), nil
}

func newAckInTransaction(_ *Router, h HandlerInfo) (middleware.Middleware, error) {
	if a, ok := h.Handler.Subscriber.(interface{ AcksInTransaction() bool }); !ok || !a.AcksInTransaction() {
		return nil, fmt.Errorf("Handler.Subscriber: %T cannot acknowledge a message in the handler's transaction (%q needs the PostgreSQL or MySQL queue of the handler's database)",
			h.Handler.Subscriber, InterceptorAckInTransaction)
	}
	return middleware.AckInTransaction(), nil
}

func newOffsets(r *Router, h HandlerInfo) (middleware.Middleware, error) {
	p, err := r.positionsFor(h.Handler)
	if err != nil {
		return nil, err
	}
	return middleware.Offsets(p, h.Name), nil
}

func newGroupCommit(r *Router, h HandlerInfo) (middleware.Middleware, error) {
	if h.Handler.Dedup.CheckFirst {
		return nil, errors.New("Handler.Dedup.CheckFirst: not supported with group commit (a group records its ids with one multi-row insert, without internal ids)")
	}
	store, ok := h.Dedup.(middleware.GroupStore)
	if !ok {
		return nil, fmt.Errorf("Handler.Dedup.Store: %T cannot record a group's ids (group commit needs RecordMany and Forget, as *dedup.SQLStore has)", h.Dedup)
	}
	opts := append(groupOptions(r, h.Handler), retentionPolicy(r, h))
	if h.Handler.Dedup.WithTimestamp {
		opts = append(opts, middleware.WithTimestampKey())
	}
	return middleware.GroupCommit(middleware.Pool(h.DB), store, h.Name, opts...)
}

func newGroupTransaction(r *Router, h HandlerInfo) (middleware.Middleware, error) {
	return middleware.GroupTransaction(middleware.Pool(h.DB), groupOptions(r, h.Handler)...)
}

func newGroupOffsets(r *Router, h HandlerInfo) (middleware.Middleware, error) {
	p, err := r.positionsFor(h.Handler)
	if err != nil {
		return nil, err
	}
	return middleware.GroupOffsets(middleware.Pool(h.DB), p, h.Name, groupOptions(r, h.Handler)...)
}

// retentionPolicy is the retention option of h's duplicate detection: its policy, and a report
// that counts and logs each message delivered beyond the retention.
func retentionPolicy(r *Router, h HandlerInfo) middleware.DedupOption {
	attrs := func(reason string) metric.AddOption {
		return metric.WithAttributes(telemetry.AttrHandler.String(h.Name), telemetry.AttrReason.String(reason))
	}
	return middleware.WithRetentionPolicy(h.Handler.Dedup.BeyondRetention, func(ctx context.Context, msg *messagedata.MessageData, reason string) {
		r.instruments.BeyondRetention.Add(ctx, 1, attrs(reason))
		h.Logger.Warn("message delivered beyond the dedup retention", "message_id", msg.ID, "reason", reason,
			"policy", h.Handler.Dedup.BeyondRetention.String(), "delivery", msg.Delivery)
	})
}

// groupOptions are the options of a group-commit interceptor for h, which records the size of
// each group it commits in r's group-size histogram.
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
