package middleware_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"
	otelglobal "go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

const producerTraceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

func tracedMsg(id string) *messagedata.MessageData {
	m := msg(id)
	m.Payload = []byte("hello")
	m.Headers = map[string]string{"traceparent": producerTraceparent}
	return m
}

func spanAttrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	out := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		out[kv.Key] = kv.Value
	}
	return out
}

func TestTracing_OutsideTheRouterEndsTheConsumerSpanWhenTheChainReturns(t *testing.T) {
	db := newDB(t)
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	p := middleware.Chain(
		middleware.Tracing{TracerProvider: tp, Propagator: propagation.TraceContext{}, MessagingSystem: "rabbitmq"}.Middleware("h"),
		middleware.Transaction{}.Middleware(middleware.Pool(db)),
	)(processor.Func(write))

	require.NoError(t, p.Process(context.Background(), tracedMsg("a")))

	ended := spans.Ended()
	require.Len(t, ended, 2)
	commit, consumer := ended[0], ended[1]
	require.Equal(t, "onceflow.commit", commit.Name())
	require.Equal(t, consumer.SpanContext().SpanID(), commit.Parent().SpanID())
	require.Equal(t, "process t", consumer.Name())
	require.Equal(t, "0af7651916cd43dd8448eb211c80319c", consumer.SpanContext().TraceID().String())
	require.Equal(t, "b7ad6b7169203331", consumer.Parent().SpanID().String())
	require.Equal(t, map[attribute.Key]attribute.Value{
		"messaging.system":            attribute.StringValue("rabbitmq"),
		"messaging.destination.name":  attribute.StringValue("t"),
		"messaging.message.id":        attribute.StringValue("a"),
		"messaging.operation.type":    attribute.StringValue("process"),
		"messaging.operation.name":    attribute.StringValue("process"),
		"messaging.message.body.size": attribute.IntValue(5),
		"onceflow.handler":            attribute.StringValue("h"),
		"onceflow.outcome":            attribute.StringValue("processed"),
	}, spanAttrs(consumer), "no onceflow.attempts without the router's delivery state")
}

func TestTracing_PanicIsRecordedAsAnError(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	p := middleware.Chain(middleware.Tracing{TracerProvider: tp}.Middleware("h"), middleware.Recover())(
		processor.Func(func(context.Context, *messagedata.MessageData) error { panic("bug") }))

	err := p.Process(context.Background(), msg("a"))
	require.Equal(t, processor.Panicked, processor.OutcomeOf(err))
	consumer := spans.Ended()[0]
	require.Equal(t, codes.Error, consumer.Status().Code)
	require.Equal(t, "processor panicked: bug", consumer.Status().Description)
	require.Equal(t, attribute.StringValue("panicked"), spanAttrs(consumer)["error.type"])
	require.Equal(t, attribute.StringValue("panicked"), spanAttrs(consumer)["onceflow.outcome"])
}

func TestTracing_DeadLetterCarriesTheConsumerSpansContext(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	b := brokertest.New()
	p := middleware.Chain(
		middleware.Tracing{TracerProvider: tp, Propagator: propagation.TraceContext{}}.Middleware("h"),
		must(middleware.DeadLetter{}.Middleware(b, "dead", "h")),
	)(processor.Func(func(context.Context, *messagedata.MessageData) error {
		return processor.Permanent(errors.New("amount is negative"))
	}))

	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(p.Process(context.Background(), tracedMsg("a"))))

	ended := spans.Ended()
	require.Len(t, ended, 2)
	send, consumer := ended[0], ended[1]
	require.Equal(t, "send dead", send.Name())
	require.Equal(t, trace.SpanKindProducer, send.SpanKind())
	require.Equal(t, consumer.SpanContext().SpanID(), send.Parent().SpanID(), "the dead letter is sent within the failed delivery")
	dead := b.Drain("dead")
	require.Len(t, dead, 1)
	sc := send.SpanContext()
	require.Equal(t, "00-"+sc.TraceID().String()+"-"+sc.SpanID().String()+"-01", dead[0].Metadata.Get("traceparent"),
		"the dead letter's parent is its send span, in the failed delivery's trace, not the original producer's")
	require.Equal(t, codes.Error, consumer.Status().Code)
}

func TestTracing_WithTheNoopProviderAllocatesNothing(t *testing.T) {
	// The no-op tracer's spans record nothing and carry their parent's span context: Tracing
	// starts none, and the parent's trace context still reaches the chain.
	prop := propagation.TraceContext{}
	var got trace.SpanContext
	p := middleware.Tracing{TracerProvider: noop.NewTracerProvider(), Propagator: prop}.Middleware("h")(
		processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
			got = trace.SpanContextFromContext(ctx)
			return nil
		}))
	m := tracedMsg("a")
	ctx := context.Background()
	require.NoError(t, p.Process(ctx, m))
	require.Equal(t, "0af7651916cd43dd8448eb211c80319c", got.TraceID().String())
	require.Equal(t, "b7ad6b7169203331", got.SpanID().String(), "the producer's span is the parent of what the chain starts")

	p = middleware.Tracing{TracerProvider: noop.NewTracerProvider()}.Middleware("h")(
		processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }))
	allocs := testing.AllocsPerRun(200, func() { _ = p.Process(ctx, m) })
	require.Zero(t, allocs)
}

// The global provider, before the application sets one, starts spans that record nothing:
// Tracing starts none then, and records once a provider is set, with no new stage.
func TestTracing_WithTheGlobalProviderRecordsOnceOneIsSet(t *testing.T) {
	if os.Getenv("ONCEFLOW_GLOBAL_TRACING") == "" {
		// The global provider is set once per process: the test runs in a process of its own.
		cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1")
		cmd.Env = append(os.Environ(), "ONCEFLOW_GLOBAL_TRACING=1")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		require.Contains(t, string(out), "PASS")
		return
	}
	var spanned bool
	p := middleware.Tracing{}.Middleware("h")(
		processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
			spanned = trace.SpanFromContext(ctx).SpanContext().IsValid()
			return nil
		}))
	m, ctx := msg("a"), context.Background()
	require.Zero(t, testing.AllocsPerRun(200, func() { _ = p.Process(ctx, m) }))
	require.False(t, spanned)

	spans := tracetest.NewSpanRecorder()
	otelglobal.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)))
	require.NoError(t, p.Process(ctx, m))
	require.True(t, spanned)
	ended := spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, "process t", ended[0].Name())
}

func TestMetrics_CountsEachDeliveryOnceByOutcome(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	outcomeOf := map[string]error{
		"ok":    nil,
		"dup":   processor.AlreadyProcessed("seen"),
		"fail":  errors.New("transient"),
		"perm":  processor.Permanent(errors.New("bad")), // not dead-lettered here: a failure
		"panic": &processor.PanicError{Value: "bug"},
	}
	mw, err := middleware.Metrics{MeterProvider: mp}.Middleware("h")
	require.NoError(t, err)
	var inflightDuring int64
	p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(ctx, &rm))
		inflightDuring = sumOf(t, rm, "onceflow.inflight", telemetry.AttrHandler.String("h"))
		return outcomeOf[m.ID]
	}))
	for _, id := range []string{"ok", "ok", "dup", "fail", "perm", "panic"} {
		_ = p.Process(context.Background(), msg(id))
	}
	require.Equal(t, int64(1), inflightDuring)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	h := telemetry.AttrHandler.String("h")
	for outcome, want := range map[processor.Outcome]int64{
		processor.Processed: 2, processor.Duplicate: 1, processor.Failed: 2, processor.Panicked: 1, processor.DeadLettered: 0,
	} {
		o := telemetry.AttrOutcome.String(string(outcome))
		require.Equal(t, want, sumOf(t, rm, "onceflow.messages", h, o), outcome)
		require.Equal(t, uint64(want), histCount(t, rm, "onceflow.process.duration", h, o), outcome)
	}
	require.Equal(t, int64(0), sumOf(t, rm, "onceflow.inflight", h))
	require.Equal(t, int64(0), sumOf(t, rm, "onceflow.retries", h), "retries are known only under the router")
}

func metricNamed(t *testing.T, rm metricdata.ResourceMetrics, name string) metricdata.Metrics {
	t.Helper()
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m
			}
		}
	}
	t.Fatalf("no metric %s", name)
	return metricdata.Metrics{}
}

func sumOf(t *testing.T, rm metricdata.ResourceMetrics, name string, kvs ...attribute.KeyValue) int64 {
	t.Helper()
	want := attribute.NewSet(kvs...)
	for _, dp := range metricNamed(t, rm, name).Data.(metricdata.Sum[int64]).DataPoints {
		if dp.Attributes.Equals(&want) {
			return dp.Value
		}
	}
	t.Fatalf("no data point of %s with %v", name, kvs)
	return 0
}

func histCount(t *testing.T, rm metricdata.ResourceMetrics, name string, kvs ...attribute.KeyValue) uint64 {
	t.Helper()
	want := attribute.NewSet(kvs...)
	for _, dp := range metricNamed(t, rm, name).Data.(metricdata.Histogram[float64]).DataPoints {
		if dp.Attributes.Equals(&want) {
			return dp.Count
		}
	}
	return 0
}
