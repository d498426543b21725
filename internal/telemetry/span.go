// Package telemetry holds the OpenTelemetry names shared by the middlewares, the router and the
// outbox (span, metric and attribute names), the header carrier, and helpers that open child
// spans only when the delivery is traced and write the trace context into outgoing messages.
//
// docs/observability.md lists every span and metric with its attributes; keep the two in step.
package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of onceflow's spans and metrics.
const ScopeName = "github.com/onceflow/onceflow"

// Span names of the child spans of a delivery's consumer span. The consumer span itself is
// named "process <topic>" (the messaging semantic conventions' "{operation} {destination}"),
// its settlement "ack <topic>" or "nack <topic>", a dead letter's producer span
// "send <dead-letter topic>".
const (
	SpanDedup   = "onceflow.dedup"
	SpanProcess = "onceflow.process"
	SpanCommit  = "onceflow.commit"
)

// Span start options, built once: building them per span would allocate.
var (
	internalKind = trace.WithSpanKind(trace.SpanKindInternal)
	clientKind   = trace.WithSpanKind(trace.SpanKindClient)
	// processOpts[n] starts the onceflow.process span of attempt n, for the usual few attempts.
	processOpts = func() [][]trace.SpanStartOption {
		opts := make([][]trace.SpanStartOption, 11)
		for n := 1; n < len(opts); n++ {
			opts[n] = []trace.SpanStartOption{internalKind, trace.WithAttributes(AttrAttempt.Int(n))}
		}
		return opts
	}()
)

// Child starts a child span of the span in ctx when that span is recording, and returns a
// function that ends it, recording err with an error status when it is not nil. When ctx has no
// recording span it allocates nothing and returns ctx unchanged.
func Child(ctx context.Context, name string) (context.Context, func(err error)) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, noEnd
	}
	ctx, span := Tracer(parent.TracerProvider()).Start(ctx, name, internalKind)
	return ctx, func(err error) { End(span, err) }
}

// StartProcess starts the onceflow.process span around one attempt of the user's processor,
// when the span in ctx is recording; otherwise it returns ctx and a nil span, allocating
// nothing.
func StartProcess(ctx context.Context, attempt int) (context.Context, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, nil
	}
	tracer := Tracer(parent.TracerProvider())
	if attempt > 0 && attempt < len(processOpts) {
		return tracer.Start(ctx, SpanProcess, processOpts[attempt]...)
	}
	return tracer.Start(ctx, SpanProcess, internalKind, trace.WithAttributes(AttrAttempt.Int(attempt)))
}

// Settlement is the start of the settle spans of one destination: "ack <destination>" and
// "nack <destination>", kind client, as the messaging semantic conventions name a settlement.
// Build it once per handler: it holds the span options, so that a span costs no allocation of
// ours.
type Settlement struct {
	ackName, nackName string
	ackOpts, nackOpts []trace.SpanStartOption
}

// NewSettlement returns the settle span starts of destination with the static attributes of
// its consumer span (messaging.system, the destination, the consumer group).
func NewSettlement(destination string, attrs ...attribute.KeyValue) *Settlement {
	opts := func(op string) []trace.SpanStartOption {
		a := append(append([]attribute.KeyValue{semconv.MessagingOperationTypeSettle, semconv.MessagingOperationName(op)}, attrs...),
			semconv.MessagingDestinationName(destination))
		return []trace.SpanStartOption{clientKind, trace.WithAttributes(a...)}
	}
	return &Settlement{ackName: "ack " + destination, nackName: "nack " + destination, ackOpts: opts("ack"), nackOpts: opts("nack")}
}

// Settle records the acknowledgement (ack true) or negative acknowledgement of a delivery as a
// child span of consumer, which may be nil. lost reports an acknowledgement that did not reach
// the subscriber (see the router); it gets an error status.
func (s *Settlement) Settle(consumer trace.Span, ack bool, lost error) {
	if consumer == nil || !consumer.IsRecording() {
		return
	}
	name, opts := s.nackName, s.nackOpts
	if ack {
		name, opts = s.ackName, s.ackOpts
	}
	ctx := trace.ContextWithSpan(context.Background(), consumer)
	_, span := Tracer(consumer.TracerProvider()).Start(ctx, name, opts...)
	End(span, lost)
}

// Send starts the producer span of a message that onceflow publishes itself (a dead letter, a
// message the outbox relays): "send <destination>", a child of the span in ctx when that span
// is recording; otherwise it returns ctx and a nil span, allocating nothing. Inject the
// returned context into the message, so that its consumers continue from this span.
func Send(ctx context.Context, destination string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, nil
	}
	a := append(append([]attribute.KeyValue{semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("send")}, attrs...),
		semconv.MessagingDestinationName(destination))
	return Tracer(parent.TracerProvider()).Start(ctx, "send "+destination, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(a...))
}

// End ends span, first recording err with an error status when err is not nil.
func End(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

func noEnd(error) {}
