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
type MetricsOption interface{ apply(*metricsConfig) }

type metricsConfig struct {
	provider metric.MeterProvider
}

type metricsOptionFunc func(*metricsConfig)

func (f metricsOptionFunc) apply(c *metricsConfig) { f(c) }

// WithMeterProvider sets the MeterProvider. Defaults to the global provider (otel.GetMeterProvider).
func WithMeterProvider(mp metric.MeterProvider) MetricsOption {
	return metricsOptionFunc(func(c *metricsConfig) { c.provider = mp })
}

var outcomes = []processor.Outcome{processor.Processed, processor.Duplicate, processor.DeadLettered, processor.Failed, processor.Panicked}

// Metrics is seed 002's performance monitor, with OpenTelemetry instruments. For each
// delivery it
//
//   - counts it once, by its final outcome, in onceflow.messages (processed, duplicate,
//     dead_lettered, failed, panicked): the outcomes add up to the deliveries;
//   - records the time from entering the middleware to the outcome, retries and their waits
//     included, in the histogram onceflow.process.duration;
//   - holds it in the up-down counter onceflow.inflight while it runs;
//   - counts its in-process retries (attempts after the first) in onceflow.retries. A retry is
//     not an outcome: a delivery that was retried ends processed, failed or dead-lettered.
//
// Every measurement carries onceflow.handler; the first two also onceflow.outcome. Retries are
// known from the delivery state the router keeps: outside the router, onceflow.retries stays 0.
// docs/observability.md lists all of onceflow's metrics, the router's included.
//
// Attribute sets are built once, when Metrics is called: a message costs no allocation here.
// It returns an error only when the meter rejects an instrument.
func Metrics(handler string, opts ...MetricsOption) (Middleware, error) {
	var cfg metricsConfig
	for _, o := range opts {
		o.apply(&cfg)
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

	// Every series starts at 0, so that rates and ratios over them are defined before the
	// first message of each outcome.
	for _, o := range outcomes {
		ins.Messages.Add(context.Background(), 0, byOutcome[o].add...)
	}
	ins.Retries.Add(context.Background(), 0, handlerOnly...)

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
