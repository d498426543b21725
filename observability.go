package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// This file holds the router's part of onceflow's telemetry: the onceflow.process span, the
// acknowledgement metrics, the settle spans' starts (the delivery ends them, in delivery.go),
// and the gauges of the dedup tables.
// docs/observability.md lists them all.

// ErrAckLost reports an acknowledgement that could not reach the subscriber: the delivery had
// ended before the router acknowledged it (its ack deadline passed, its subscription closed,
// its connection was lost), or it had been nacked. The broker delivers the message again; when
// the transaction had committed, duplicate detection acknowledges the copy without applying it
// again.
var ErrAckLost = errors.New("acknowledgement lost")

var errProcessorPanicked = errors.New("processor panicked")

// traceProcessor wraps the user's processor, innermost in the chain, in the onceflow.process
// span: one per attempt, a child of the consumer span or of nothing when the delivery is not
// traced. A duplicate reported by the processor (natural idempotency) is not an error.
func traceProcessor(p processor.Processor) processor.Processor {
	return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		ctx, span := telemetry.StartProcess(ctx, max(msg.Attempt, 1))
		if span == nil {
			return p.Process(ctx, msg)
		}
		finished := false
		defer func() {
			if !finished { // panicking: end the span and let the panic go on to Recover
				telemetry.End(span, errProcessorPanicked)
			}
		}()
		err := p.Process(ctx, msg)
		finished = true
		if err != nil && !processor.IsDuplicate(err) {
			telemetry.End(span, err)
		} else {
			span.End()
		}
		return err
	})
}

// initHandlerMetrics starts the router's counters of a handler at 0, so that they are exported
// before the first failure.
func initHandlerMetrics(ins *telemetry.Instruments, handler string) {
	ctx := context.Background()
	for _, o := range []processor.Outcome{processor.Processed, processor.Duplicate, processor.DeadLettered} {
		ins.AckFailures.Add(ctx, 0,
			metric.WithAttributes(telemetry.AttrHandler.String(handler), telemetry.AttrOutcome.String(string(o))))
	}
	ins.DeadLetterFails.Add(ctx, 0, metric.WithAttributes(telemetry.AttrHandler.String(handler)))
	for _, reason := range []string{dedup.BeyondExpiredKey, dedup.BeyondOldMessage} {
		ins.BeyondRetention.Add(ctx, 0, metric.WithAttributes(telemetry.AttrHandler.String(handler), telemetry.AttrReason.String(reason)))
	}
}

// registerDedupGauges registers on mp the gauges of the dedup tables that stores returns,
// observed at each collection with SQLStore.Stats (one statement that reads the table). A View
// that drops all three gauges stops the reads.
func registerDedupGauges(mp metric.MeterProvider, logger *slog.Logger, dedupStores func() map[storeKey]*dedup.SQLStore) (metric.Registration, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := telemetry.Meter(mp)
	g, err := telemetry.NewDedupGauges(meter)
	if err != nil {
		return nil, fmt.Errorf("create dedup gauges: %w", err)
	}
	reg, err := meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		for k, s := range dedupStores() {
			st, err := s.Stats(ctx)
			if err != nil {
				logger.Warn("cannot read the dedup table for its gauges", "table", s.Table(), "error", err)
				continue
			}
			attrs := metric.WithAttributeSet(attribute.NewSet(telemetry.AttrDedupTable.String(s.Table()), dbSystem(k.db)))
			o.ObserveInt64(g.Rows, st.Rows, attrs)
			o.ObserveInt64(g.Expired, st.Expired, attrs)
			age := 0.0
			if !st.Oldest.IsZero() {
				age = max(secondsSince(st.Oldest), 0)
			}
			o.ObserveFloat64(g.OldestAge, age, attrs)
		}
		return nil
	}, g.Observables()...)
	if err != nil {
		return nil, fmt.Errorf("register dedup gauges: %w", err)
	}
	return reg, nil
}

// registerPausedGauge registers on mp the gauge onceflow.handler.paused of handlers: how long
// each has been paused by an outage, with its reason (onceflow.reason), 0 while it runs.
func registerPausedGauge(mp metric.MeterProvider, handlers []*consumer) (metric.Registration, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := telemetry.Meter(mp)
	g, err := telemetry.NewPausedGauge(meter)
	if err != nil {
		return nil, fmt.Errorf("create the paused gauge: %w", err)
	}
	reg, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, c := range handlers {
			st, seconds := c.stats.state(), 0.0
			attrs := []attribute.KeyValue{telemetry.AttrHandler.String(c.name)}
			if st.Kind == StatePaused {
				seconds = max(secondsSince(st.Since), 0)
				attrs = append(attrs, telemetry.AttrReason.String(st.Reason))
			}
			o.ObserveFloat64(g, seconds, metric.WithAttributes(attrs...))
		}
		return nil
	}, g)
	if err != nil {
		return nil, fmt.Errorf("register the paused gauge: %w", err)
	}
	return reg, nil
}

// dbSystem returns the db.system.name attribute of db, in the semantic conventions' values.
func dbSystem(db *sqldb.DB) attribute.KeyValue {
	switch db.Dialect {
	case sqldb.Postgres:
		return semconv.DBSystemNamePostgreSQL
	case sqldb.MySQL:
		return semconv.DBSystemNameMySQL
	case sqldb.SQLite:
		return semconv.DBSystemNameSQLite
	}
	return semconv.DBSystemNameKey.String(string(db.Dialect))
}

func secondsSince(t time.Time) float64 { return time.Since(t).Seconds() }

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

// newSettlement returns the settle span starts of a handler's topic.
func newSettlement(topic, system, group string) *telemetry.Settlement {
	attrs := []attribute.KeyValue{semconv.MessagingSystemKey.String(system)}
	if group != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(group))
	}
	return telemetry.NewSettlement(topic, attrs...)
}
