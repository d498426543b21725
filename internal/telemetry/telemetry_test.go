package telemetry_test

import (
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/onceflow/onceflow/internal/telemetry"
)

// docs/observability.md is the reference of every name here; keep it in step.
func TestNames_AreAllDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../docs/observability.md")
	require.NoError(t, err)
	for _, name := range []string{
		telemetry.MetricMessages, telemetry.MetricProcessDuration, telemetry.MetricInflight, telemetry.MetricRetries,
		telemetry.MetricCommitToAck, telemetry.MetricGroupSize, telemetry.MetricAckFailures, telemetry.MetricDedupRows, telemetry.MetricDedupExpired,
		telemetry.MetricDedupOldestAge, telemetry.MetricOutboxBacklog, telemetry.MetricOutboxLag,
		telemetry.MetricOrderSweepErrors, telemetry.MetricDedupBeyond, telemetry.MetricDeadLetterErrors, telemetry.MetricHandlerPaused, string(telemetry.AttrReason),
		// MetricOrderParked and MetricOrderGapTimeouts are documented with the in-order chain.
		telemetry.SpanDedup, telemetry.SpanProcess, telemetry.SpanCommit, telemetry.MetricConsumedMessages, telemetry.MetricMessagingProcessDuration,
		string(telemetry.AttrHandler), string(telemetry.AttrOutcome), string(telemetry.AttrAttempts),
		string(telemetry.AttrAttempt), string(telemetry.AttrDedupTable),
	} {
		require.Contains(t, string(doc), "`"+name+"`", "docs/observability.md does not list %s", name)
	}
}

func TestChild_WithoutARecordingSpanAllocatesNothing(t *testing.T) {
	ctx := trace.ContextWithSpan(context.Background(), noop.Span{})
	settlement := telemetry.NewSettlement("orders")
	allocs := testing.AllocsPerRun(100, func() {
		c, end := telemetry.Child(ctx, telemetry.SpanCommit)
		end(nil)
		_, span := telemetry.StartProcess(c, 1)
		if span != nil {
			t.Fatal("a process span without a recording parent")
		}
		settlement.Settle(nil, true, nil)
	})
	require.Zero(t, allocs)
}

func TestInject_UsesThePropagatorInTheContextAndReplacesTheIncomingTraceparent(t *testing.T) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
	ctx, span := tp.Tracer("t").Start(context.Background(), "consumer")
	defer span.End()

	headers := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	telemetry.Inject(telemetry.WithPropagator(ctx, propagation.TraceContext{}), headers)
	sc := span.SpanContext()
	require.Equal(t, "00-"+sc.TraceID().String()+"-"+sc.SpanID().String()+"-01", headers["traceparent"])

	// The global propagator propagates nothing until the application sets one.
	untouched := map[string]string{}
	telemetry.Inject(ctx, untouched)
	require.Empty(t, untouched)
}

func TestHeaderCarrier_Keys(t *testing.T) {
	c := telemetry.HeaderCarrier{"traceparent": "x", "b": "y"}
	keys := c.Keys()
	require.ElementsMatch(t, []string{"traceparent", "b"}, keys)
	require.Equal(t, "x", c.Get("traceparent"))
	c.Set("tracestate", "z")
	require.Equal(t, "z", c["tracestate"])
}
