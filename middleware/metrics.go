package middleware

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// MetricsOption configures Metrics.
type MetricsOption interface{ applyMetrics(*metricsConfig) }

type metricsConfig struct {
	provider metric.MeterProvider
}

type metricsOptionFunc func(*metricsConfig)

func (f metricsOptionFunc) applyMetrics(c *metricsConfig) { f(c) }

// WithMeterProvider sets the MeterProvider. Defaults to the global provider (otel.GetMeterProvider).
func WithMeterProvider(mp metric.MeterProvider) MetricsOption {
	return metricsOptionFunc(func(c *metricsConfig) { c.provider = mp })
}

var outcomes = []processor.Outcome{processor.Processed, processor.Duplicate, processor.DeadLettered, processor.Failed, processor.Panicked}

// Metrics is seed 002's performance monitor, with OpenTelemetry instruments: it counts
// deliveries by handler and outcome (onceflow.messages), measures the processing time of each
// (onceflow.process.duration, retries included), tracks the deliveries in flight
// (onceflow.inflight) and counts retries (onceflow.retries). Every measurement carries the
// attribute onceflow.handler; the first two also onceflow.outcome. docs/observability.md lists
// all of onceflow's metrics.
//
// It returns an error only when the meter rejects an instrument.
func Metrics(handler string, opts ...MetricsOption) (Middleware, error) {
	var cfg metricsConfig
	for _, o := range opts {
		o.applyMetrics(&cfg)
	}
	if cfg.provider == nil {
		cfg.provider = otel.GetMeterProvider()
	}
	ins, err := telemetry.NewInstruments(cfg.provider.Meter(telemetry.ScopeName))
	if err != nil {
		return nil, fmt.Errorf("create metric instruments: %w", err)
	}
	handlerAttr := AttrHandler.String(handler)
	// Options are built once: passing a prebuilt slice to the variadic instrument methods
	// allocates nothing per message.
	handlerOnly := []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(handlerAttr))}
	type outcomeOpts struct {
		add    []metric.AddOption
		record []metric.RecordOption
	}
	byOutcome := make(map[processor.Outcome]outcomeOpts, len(outcomes))
	for _, o := range outcomes {
		set := metric.WithAttributeSet(attribute.NewSet(handlerAttr, AttrOutcome.String(string(o))))
		byOutcome[o] = outcomeOpts{add: []metric.AddOption{set}, record: []metric.RecordOption{set}}
	}

	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			start := time.Now()
			ins.Inflight.Add(ctx, 1, handlerOnly...)
			retriesBefore := 0
			st := delivery.From(ctx)
			if st != nil {
				retriesBefore = st.Retries
			}
			err := next.Process(ctx, msg)
			outcome := byOutcome[processor.OutcomeOf(err)]
			ins.Inflight.Add(ctx, -1, handlerOnly...)
			ins.Messages.Add(ctx, 1, outcome.add...)
			ins.ProcessDuration.Record(ctx, time.Since(start).Seconds(), outcome.record...)
			if st != nil && st.Retries > retriesBefore {
				ins.Retries.Add(ctx, int64(st.Retries-retriesBefore), handlerOnly...)
			}
			return err
		})
	}, nil
}
