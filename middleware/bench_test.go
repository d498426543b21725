package middleware_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// memTx is an in-memory stand-in for a transaction: every statement succeeds at once.
type memTx struct{}

func (memTx) DriverName() string                               { return "memory" }
func (memTx) Rebind(q string) string                           { return q }
func (memTx) BindNamed(q string, _ any) (string, []any, error) { return q, nil, nil }
func (memTx) QueryContext(context.Context, string, ...any) (*sql.Rows, error) {
	return nil, nil
}
func (memTx) QueryxContext(context.Context, string, ...any) (*sqlx.Rows, error) {
	return nil, nil
}
func (memTx) QueryRowxContext(context.Context, string, ...any) *sqlx.Row { return nil }
func (memTx) ExecContext(context.Context, string, ...any) (sql.Result, error) {
	return nil, nil
}
func (memTx) Commit() error   { return nil }
func (memTx) Rollback() error { return nil }

type memDB struct{ tx memTx }

func (db *memDB) BeginTx(context.Context, *sql.TxOptions) (middleware.Tx, error) { return db.tx, nil }

// memStore records nothing and reports every key as new.
type memStore struct{}

func (memStore) Record(context.Context, sqlx.ExtContext, dedup.Key, string) (bool, error) {
	return true, nil
}
func (memStore) Lookup(context.Context, sqlx.ExtContext, dedup.Key) (string, bool, error) {
	return "", false, nil
}

func canonicalChain(b *testing.B) processor.Processor {
	return canonicalChainWith(b, processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }), nil, nil)
}

// canonicalChainWith builds the exactly-once chain around p, with the given telemetry options
// (none: the global providers).
func canonicalChainWith(b *testing.B, p processor.Processor, tracing []middleware.TracingOption, metrics []middleware.MetricsOption) processor.Processor {
	monitor, err := middleware.Metrics("bench", metrics...)
	if err != nil {
		b.Fatal(err)
	}
	chain := middleware.Chain(
		middleware.Tracing("bench", tracing...),
		monitor,
		must(middleware.DeadLetter(brokertest.New(), "dead", "bench")),
		middleware.Recover(),
		must(middleware.Retry()),
		middleware.Transaction(&memDB{}),
		must(middleware.Deduplicate(memStore{}, "bench")),
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

func benchmarkAsRouter(b *testing.B, tracing []middleware.TracingOption, metrics []middleware.MetricsOption) {
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
	benchmarkAsRouter(b, nil, nil)
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
	benchmarkAsRouter(b,
		[]middleware.TracingOption{middleware.WithTracerProvider(tp), middleware.WithPropagator(propagation.TraceContext{})},
		[]middleware.MetricsOption{middleware.WithMeterProvider(mp)})
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
	benchmarkAsRouter(b,
		[]middleware.TracingOption{middleware.WithTracerProvider(tp), middleware.WithPropagator(propagation.TraceContext{})},
		[]middleware.MetricsOption{middleware.WithMeterProvider(mp)})
}
