package telemetry

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
)

// HeaderCarrier adapts message headers to the propagation.TextMapCarrier that propagators read
// and write (the W3C traceparent and tracestate headers, baggage).
type HeaderCarrier map[string]string

var _ propagation.TextMapCarrier = HeaderCarrier{}

// Get returns the value of header key.
func (c HeaderCarrier) Get(key string) string { return c[key] }

// Set sets header key to value. It must not be called on a nil carrier.
func (c HeaderCarrier) Set(key, value string) { c[key] = value }

// Keys lists the header names.
func (c HeaderCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

type propagatorKey struct{}

// WithPropagator returns a context that carries p, the propagator the Tracing middleware was
// configured with, for the middlewares inside it that publish messages.
func WithPropagator(ctx context.Context, p propagation.TextMapPropagator) context.Context {
	return context.WithValue(ctx, propagatorKey{}, p)
}

// Propagator returns the propagator carried by ctx, or the global one
// (otel.GetTextMapPropagator).
func Propagator(ctx context.Context) propagation.TextMapPropagator {
	if p, ok := ctx.Value(propagatorKey{}).(propagation.TextMapPropagator); ok {
		return p
	}
	return otel.GetTextMapPropagator()
}

// Inject writes the trace context of ctx into headers with Propagator(ctx): an outgoing
// message becomes a child of the span that sends it. When ctx carries a valid span context,
// the trace headers copied from the incoming message are overwritten; otherwise they are left
// as they are. headers must not be nil.
func Inject(ctx context.Context, headers map[string]string) {
	Propagator(ctx).Inject(ctx, HeaderCarrier(headers))
}
