package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/memtx"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// memStore records nothing and reports every key as new.
type memStore struct{}

func (memStore) Record(context.Context, sqlx.ExtContext, dedup.Key, string) (bool, error) {
	return true, nil
}
func (memStore) Lookup(context.Context, sqlx.ExtContext, dedup.Key) (string, bool, error) {
	return "", false, nil
}

func canonicalChain(b *testing.B) processor.Processor {
	return canonicalChainWith(b, processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }), middleware.Tracing{}, middleware.Metrics{})
}

// canonicalChainWith builds the exactly-once chain around p, with the given telemetry
// configurations (the zero ones: the global providers).
func canonicalChainWith(b *testing.B, p processor.Processor, tracing middleware.Tracing, metrics middleware.Metrics) processor.Processor {
	monitor, err := metrics.Middleware("bench")
	if err != nil {
		b.Fatal(err)
	}
	chain := middleware.Chain(
		tracing.Middleware("bench"),
		monitor,
		must(middleware.DeadLetter{}.Middleware(brokertest.New(), "dead", "bench")),
		middleware.Recover(),
		must(middleware.Retry{}.Middleware()),
		middleware.Transaction{}.Middleware(memtx.DB{}),
		must(middleware.Dedup{Store: memStore{}}.Middleware(nil, "bench")),
	)
	return chain(p)
}

// BenchmarkCanonicalChain measures what the exactly-once chain costs per message around a
// processor that does nothing, with an in-memory transaction and store: the framework's own
// overhead, without the database. Target: under 2 µs and 20 allocations per message.
func BenchmarkCanonicalChain(b *testing.B) {
	p := canonicalChain(b)
	msg := &messagedata.MessageData{ID: "0198e0c2-7a4b-7c3e-9f1a-2b3c4d5e6f70", Topic: "orders", Payload: []byte(`{"amount":1}`)}
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if err := p.Process(ctx, msg); err != nil {
			b.Fatal(err)
		}
	}
}

// processSpan is what the router puts around the user's processor: the onceflow.process span.
func processSpan(p processor.Processor) processor.Processor {
	return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		ctx, span := telemetry.StartProcess(ctx, max(msg.Attempt, 1))
		err := p.Process(ctx, msg)
		if span != nil {
			telemetry.End(span, err)
		}
		return err
	})
}

// settlement is the settle span start of the benchmarks' topic.
var settlement = telemetry.NewSettlement("orders")

// runAsRouter processes msg through p the way the router does: with a delivery state, then the
// ack span and the end of the consumer span that Tracing leaves open.
func runAsRouter(b *testing.B, p processor.Processor, msg *messagedata.MessageData) {
	st := &delivery.State{Handler: "bench", Received: time.Now()}
	err := p.Process(delivery.With(context.Background(), st), msg)
	if err != nil {
		b.Fatal(err)
	}
	if st.Span != nil {
		settlement.Settle(st.Span, true, nil)
		st.Span.End()
	}
}

func benchmarkAsRouter(b *testing.B, tracing middleware.Tracing, metrics middleware.Metrics) {
	p := canonicalChainWith(b, processSpan(processor.Func(func(context.Context, *messagedata.MessageData) error { return nil })), tracing, metrics)
	msg := &messagedata.MessageData{ID: "0198e0c2-7a4b-7c3e-9f1a-2b3c4d5e6f70", Topic: "orders", Payload: []byte(`{"amount":1}`)}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		runAsRouter(b, p, msg)
	}
}

// BenchmarkCanonicalChainAsRouter is BenchmarkCanonicalChain run the way the router runs a
// chain (delivery state, process span wrapper, ack span), with the global no-op providers: the
// baseline of BenchmarkCanonicalChainWithTelemetry.
func BenchmarkCanonicalChainAsRouter(b *testing.B) {
	benchmarkAsRouter(b, middleware.Tracing{}, middleware.Metrics{})
}

// discardExporter drops every span: the benchmark measures onceflow's instrumentation and the
// SDK, not an exporter.
type discardExporter struct{}

func (discardExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardExporter) Shutdown(context.Context) error                             { return nil }

// BenchmarkCanonicalChainWithTelemetry is BenchmarkCanonicalChainAsRouter with the
// OpenTelemetry SDK: every message sampled, five spans (consumer, dedup, process, commit, ack)
// through a batch span processor into an exporter that discards them, and the metrics recorded
// into a MeterProvider with a ManualReader. docs/observability.md reports the overhead.
func BenchmarkCanonicalChainWithTelemetry(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithBatcher(discardExporter{}))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	b.Cleanup(func() {
		_ = tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	})
	benchmarkAsRouter(b, middleware.Tracing{TracerProvider: tp, Propagator: propagation.TraceContext{}}, middleware.Metrics{MeterProvider: mp})
}

// BenchmarkCanonicalChainWithTelemetryUnsampled is BenchmarkCanonicalChainWithTelemetry with
// every trace sampled out: the SDK is installed, metrics are recorded, and no span records.
func BenchmarkCanonicalChainWithTelemetryUnsampled(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()), sdktrace.WithBatcher(discardExporter{}))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	b.Cleanup(func() {
		_ = tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	})
	benchmarkAsRouter(b, middleware.Tracing{TracerProvider: tp, Propagator: propagation.TraceContext{}}, middleware.Metrics{MeterProvider: mp})
}
