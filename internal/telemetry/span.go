// Package telemetry holds the OpenTelemetry names shared by the middlewares, the router and the
// outbox (span, metric and attribute names), the header carrier, and helpers that open child
// spans only when the delivery is traced and write the trace context into outgoing messages.
//
// docs/observability.md lists every span and metric with its attributes; keep the two in step.
package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of onceflow's spans and metrics.
const ScopeName = "github.com/onceflow/onceflow"

// Span names of the child spans of a delivery's consumer span. The consumer span itself is
// named "process <topic>" (the messaging semantic conventions' "{operation} {destination}").
const (
	SpanDedup   = "onceflow.dedup"
	SpanProcess = "onceflow.process"
	SpanCommit  = "onceflow.commit"
	SpanAck     = "onceflow.ack"
)

// Span start options, built once: building them per span would allocate.
var (
	internalKind = trace.WithSpanKind(trace.SpanKindInternal)
	ackOpts      = []trace.SpanStartOption{internalKind, trace.WithAttributes(semconv.MessagingOperationTypeSettle, semconv.MessagingOperationName("ack"))}
	nackOpts     = []trace.SpanStartOption{internalKind, trace.WithAttributes(semconv.MessagingOperationTypeSettle, semconv.MessagingOperationName("nack"))}
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
	ctx, span := parent.TracerProvider().Tracer(ScopeName).Start(ctx, name, internalKind)
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
	tracer := parent.TracerProvider().Tracer(ScopeName)
	if attempt > 0 && attempt < len(processOpts) {
		return tracer.Start(ctx, SpanProcess, processOpts[attempt]...)
	}
	return tracer.Start(ctx, SpanProcess, internalKind, trace.WithAttributes(AttrAttempt.Int(attempt)))
}

// Settle records the acknowledgement (ack true) or negative acknowledgement of a delivery as
// the onceflow.ack child span of consumer, which may be nil. lost reports an acknowledgement
// that did not reach the subscriber (see the router); it gets an error status.
func Settle(consumer trace.Span, ack bool, lost error) {
	if consumer == nil || !consumer.IsRecording() {
		return
	}
	opts := nackOpts
	if ack {
		opts = ackOpts
	}
	ctx := trace.ContextWithSpan(context.Background(), consumer)
	_, span := consumer.TracerProvider().Tracer(ScopeName).Start(ctx, SpanAck, opts...)
	End(span, lost)
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
