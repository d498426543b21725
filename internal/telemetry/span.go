// Package telemetry holds the OpenTelemetry names shared by the middlewares and the router,
// and a helper that opens child spans only when the delivery is traced.
package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of onceflow's spans and metrics.
const ScopeName = "github.com/onceflow/onceflow"

// Span names of the child spans of a delivery's consumer span.
const (
	SpanDedup   = "onceflow.dedup"
	SpanProcess = "onceflow.process"
	SpanCommit  = "onceflow.commit"
	SpanAck     = "onceflow.ack"
)

// Child starts a child span of the span in ctx when that span is recording, and returns a
// function that ends it, recording err with an error status when it is not nil. When ctx has no
// recording span it allocates nothing and returns ctx unchanged.
func Child(ctx context.Context, name string) (context.Context, func(err error)) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return ctx, noEnd
	}
	ctx, span := parent.TracerProvider().Tracer(ScopeName).Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal))
	return ctx, func(err error) {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

func noEnd(error) {}
