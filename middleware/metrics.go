package middleware

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

var outcomes = [...]processor.Outcome{processor.Processed, processor.Duplicate, processor.DeadLettered, processor.Failed, processor.Panicked}

// outcomeIndex returns the place of oc, one of processor.OutcomeOf's, in outcomes: the options
// of the measurements of each outcome are kept in arrays, which a delivery reads at less cost
// than a map.
func outcomeIndex(oc processor.Outcome) int { return slices.Index(outcomes[:], oc) }

// Metrics configures the metrics stage, the performance monitor of the chain, with
// OpenTelemetry instruments. For each delivery it
//
//   - counts it once, by its final outcome, in onceflow.messages (processed, duplicate,
//     dead_lettered, failed, panicked): the outcomes add up to the deliveries;
//   - records the time from entering the stage to the outcome, retries and their waits
//     included, in the histogram onceflow.process.duration;
//   - holds it in the up-down counter onceflow.inflight while it runs;
//   - counts its in-process retries (attempts after the first) in onceflow.retries. A retry is
//     not an outcome: a delivery that was retried ends processed, failed or dead-lettered;
//   - records the OpenTelemetry messaging semantic-convention metrics beside onceflow's own:
//     messaging.client.consumed.messages (counter) and messaging.process.duration (histogram),
//     with messaging.system, messaging.destination.name, messaging.consumer.group.name (when
//     known), messaging.operation.name "process", and error.type (the outcome) for a delivery
//     that failed, panicked or was dead-lettered.
//
// Every onceflow measurement carries onceflow.handler; the first two also onceflow.outcome.
// Retries are known from the delivery state the router keeps: outside the router,
// onceflow.retries stays 0. docs/observability.md lists all of onceflow's metrics, the router's
// included. The zero value is the default configuration.
//
// Attribute sets are built once, with the stage. A message costs no allocation here under the
// router, which gives each delivery a state that holds its start; elsewhere one small one.
type Metrics struct {
	// MeterProvider provides the meter. Defaults to the global provider
	// (otel.GetMeterProvider).
	MeterProvider metric.MeterProvider
	// MessagingSystem and ConsumerGroup describe the broker in the semantic-convention metrics,
	// as they do for Tracing.
	MessagingSystem, ConsumerGroup string
}

// Middleware returns the metrics stage of m for handler: Observe of its Observer. It returns an
// error only when the meter rejects an instrument.
func (m Metrics) Middleware(handler string) (Middleware, error) {
	o, err := m.Observer(handler)
	if err != nil {
		return nil, err
	}
	return Observe(o), nil
}

// Observer returns the Observer the metrics stage of m for handler is made of: Begin counts the
// delivery in flight and notes its start, End records its outcome. It returns an error only
// when the meter rejects an instrument.
func (m Metrics) Observer(handler string) (Observer, error) {
	provider := m.MeterProvider
	if provider == nil {
		provider = otel.GetMeterProvider()
	}
	meter := telemetry.Meter(provider)
	ins, err := telemetry.NewInstruments(meter)
	if err != nil {
		return nil, fmt.Errorf("create metric instruments: %w", err)
	}
	conv, err := telemetry.NewConventionInstruments(meter)
	if err != nil {
		return nil, fmt.Errorf("create metric instruments: %w", err)
	}
	convSets := &conventionSets{messaging: messaging(m.MessagingSystem, m.ConsumerGroup)}
	handlerAttr := telemetry.AttrHandler.String(handler)
	// Options are built once: passing a prebuilt slice to the variadic instrument methods
	// allocates nothing per message.
	handlerOnly := []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(handlerAttr))}
	var byOutcome [len(outcomes)]outcomeOpts
	for i, o := range outcomes {
		set := metric.WithAttributeSet(attribute.NewSet(handlerAttr, telemetry.AttrOutcome.String(string(o))))
		byOutcome[i] = optsOf(set)
	}

	// Every series starts at 0, so that rates and ratios over them are defined before the
	// first message of each outcome.
	for _, o := range byOutcome {
		ins.Messages.Add(context.Background(), 0, o.add...)
	}
	ins.Retries.Add(context.Background(), 0, handlerOnly...)

	return &metricsObserver{ins: ins, conv: conv, convSets: convSets, handlerOnly: handlerOnly, byOutcome: byOutcome}, nil
}

// outcomeOpts are the options of the measurements of one outcome.
type outcomeOpts struct {
	add    []metric.AddOption
	record []metric.RecordOption
}

// optsOf returns the options of measurements with the attributes of set.
func optsOf(set metric.MeasurementOption) outcomeOpts {
	return outcomeOpts{add: []metric.AddOption{set}, record: []metric.RecordOption{set}}
}

type metricsObserver struct {
	ins         *telemetry.Instruments
	conv        *telemetry.ConventionInstruments
	convSets    *conventionSets
	handlerOnly []metric.AddOption
	byOutcome   [len(outcomes)]outcomeOpts // by outcomeIndex
}

// metricsBegun is the context Begin returns when the delivery's state cannot hold what it
// began with (outside the router, or for a second metrics stage): when the delivery began and
// how many retries it had then.
type metricsBegun struct {
	context.Context
	start   time.Time
	retries int
}

// Begin notes when the delivery began, and its retries then, in the delivery's state when it
// has one that no other metrics stage uses, and otherwise in the context it returns: under the
// router a delivery costs no allocation here.
func (o *metricsObserver) Begin(ctx context.Context, _ *messagedata.MessageData) context.Context {
	o.ins.Inflight.Add(ctx, 1, o.handlerOnly...)
	st := delivery.From(ctx)
	if st != nil && !st.Metered {
		st.Metered, st.MeteredFrom, st.MeteredRetries = true, time.Now(), st.Retries
		return ctx
	}
	b := &metricsBegun{Context: ctx, start: time.Now()}
	if st != nil {
		b.retries = st.Retries
	}
	return b
}

func (o *metricsObserver) End(ctx context.Context, msg *messagedata.MessageData, err error) {
	start, retriesBefore := time.Now(), 0
	if b, ok := ctx.(*metricsBegun); ok {
		start, retriesBefore = b.start, b.retries
	} else if st := delivery.From(ctx); st != nil && st.Metered {
		start, retriesBefore = st.MeteredFrom, st.MeteredRetries
		st.Metered = false
	}
	oc := outcomeIndex(processor.OutcomeOf(err))
	outcome := o.byOutcome[oc]
	o.ins.Inflight.Add(ctx, -1, o.handlerOnly...)
	o.ins.Messages.Add(ctx, 1, outcome.add...)
	elapsed := time.Since(start).Seconds()
	o.ins.ProcessDuration.Record(ctx, elapsed, outcome.record...)
	cs := o.convSets.get(msg.Topic).byOutcome[oc]
	o.conv.Consumed.Add(ctx, 1, cs.add...)
	o.conv.ProcessDuration.Record(ctx, elapsed, cs.record...)
	if st := delivery.From(ctx); st != nil && st.Retries > retriesBefore {
		o.ins.Retries.Add(ctx, int64(st.Retries-retriesBefore), o.handlerOnly...)
	}
}

// conventionSets caches the attribute sets of the semantic-convention metrics for the topic a
// handler consumes, by outcome, so that a message costs no allocation here.
type conventionSets struct {
	messaging messagingConfig
	cached    atomic.Pointer[topicSets]
}

type topicSets struct {
	topic     string
	byOutcome [len(outcomes)]outcomeOpts // by outcomeIndex
}

func (c *conventionSets) get(topic string) *topicSets {
	if s := c.cached.Load(); s != nil && s.topic == topic {
		return s
	}
	base := append(c.messaging.attrs(), semconv.MessagingDestinationName(topic), semconv.MessagingOperationName("process"))
	s := &topicSets{topic: topic}
	for i, o := range outcomes {
		attrs := base
		if o == processor.Failed || o == processor.Panicked || o == processor.DeadLettered {
			attrs = append(append([]attribute.KeyValue(nil), base...), semconv.ErrorTypeKey.String(string(o)))
		}
		set := metric.WithAttributeSet(attribute.NewSet(attrs...))
		s.byOutcome[i] = optsOf(set)
	}
	c.cached.Store(s)
	return s
}
