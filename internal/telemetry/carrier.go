package telemetry

import (
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
