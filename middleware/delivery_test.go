package middleware_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// Retry records its retries in the delivery, which Metrics counts, Tracing reports and the
// processor reads.
func TestDelivery_RetriesRecordedByRetryAreCountedByMetricsAndTracing(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	metrics, err := middleware.Metrics{MeterProvider: mp}.Middleware("h")
	require.NoError(t, err)
	var seen []int
	p := middleware.Chain(middleware.Tracing{TracerProvider: tp}.Middleware("h"), metrics,
		must(middleware.Retry{InitialInterval: time.Nanosecond}.Middleware()))(
		processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
			d, ok := middleware.DeliveryFrom(ctx)
			require.True(t, ok)
			seen = append(seen, d.Retries())
			if d.Retries() == 0 {
				return errors.New("transient")
			}
			return nil
		}))

	ctx, st := delivery.Start(context.Background(), "h", time.Now())
	st.EndSpanInChain = true // no router acknowledges it: the span ends with the chain
	require.NoError(t, p.Process(ctx, msg("a")))

	require.Equal(t, []int{0, 1}, seen)
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	require.Equal(t, int64(1), sumOf(t, rm, "onceflow.retries", telemetry.AttrHandler.String("h")))
	ended := spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, attribute.IntValue(2), spanAttrs(ended[0])["onceflow.attempts"])
}

// Under the router each metrics stage of a chain times and counts what it wraps: the outer one
// the delivery with its retry, the inner one each attempt; the delivery's state holds the
// outer one's start, so that a delivery costs it no allocation.
func TestMetrics_UnderTheRouterEachStageMeasuresWhatItWraps(t *testing.T) {
	readers := [2]*sdkmetric.ManualReader{sdkmetric.NewManualReader(), sdkmetric.NewManualReader()}
	var stages [2]middleware.Middleware
	for i, r := range readers {
		var err error
		stages[i], err = middleware.Metrics{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))}.Middleware("h")
		require.NoError(t, err)
	}
	p := middleware.Chain(stages[0], must(middleware.Retry{InitialInterval: time.Nanosecond}.Middleware()), stages[1])(
		processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
			if d, _ := middleware.DeliveryFrom(ctx); d.Retries() == 0 {
				time.Sleep(20 * time.Millisecond)
				return errors.New("transient")
			}
			return nil
		}))
	ctx, _ := delivery.Start(context.Background(), "h", time.Now())
	require.NoError(t, p.Process(ctx, msg("a")))

	h := telemetry.AttrHandler.String("h")
	collect := func(r *sdkmetric.ManualReader) metricdata.ResourceMetrics {
		var rm metricdata.ResourceMetrics
		require.NoError(t, r.Collect(context.Background(), &rm))
		return rm
	}
	outer, inner := collect(readers[0]), collect(readers[1])
	require.Equal(t, int64(1), sumOf(t, outer, "onceflow.messages", h, telemetry.AttrOutcome.String("processed")))
	require.Equal(t, int64(0), sumOf(t, outer, "onceflow.messages", h, telemetry.AttrOutcome.String("failed")))
	require.Equal(t, int64(1), sumOf(t, outer, "onceflow.retries", h))
	require.Equal(t, int64(0), sumOf(t, outer, "onceflow.inflight", h))
	require.Equal(t, int64(1), sumOf(t, inner, "onceflow.messages", h, telemetry.AttrOutcome.String("processed")))
	require.Equal(t, int64(1), sumOf(t, inner, "onceflow.messages", h, telemetry.AttrOutcome.String("failed")))
	require.Equal(t, int64(0), sumOf(t, inner, "onceflow.retries", h))
	require.Equal(t, int64(0), sumOf(t, inner, "onceflow.inflight", h))
	slow := metricNamed(t, outer, "onceflow.process.duration").Data.(metricdata.Histogram[float64]).DataPoints
	require.Len(t, slow, 1)
	require.GreaterOrEqual(t, slow[0].Sum, 0.02, "the outer stage's time has the failed attempt in it")

	o, err := middleware.Metrics{MeterProvider: metricnoop.NewMeterProvider()}.Observer("h")
	require.NoError(t, err)
	m := msg("a")
	require.Zero(t, testing.AllocsPerRun(100, func() { o.End(o.Begin(ctx, m), m, nil) }))
}

// Delivery.Permanent answers with the classifier of the chain's dead-letter stage, which
// records it when the delivery enters it; the default classifier before, and outside a
// delivery.
func TestDelivery_PermanentIsTheDeadLetterStagesClassifier(t *testing.T) {
	tooLong := errors.New("a value of the message's own that the database refuses")
	var zero middleware.Delivery
	require.False(t, zero.Permanent(tooLong))
	require.True(t, zero.Permanent(processor.Permanent(tooLong)))

	var inside middleware.Delivery
	p := must(middleware.DeadLetter{Classifier: func(err error) bool { return errors.Is(err, tooLong) }}.Middleware(failingPublisher{}, "dead", "h"))(
		processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
			inside, _ = middleware.DeliveryFrom(ctx)
			return nil
		}))
	require.NoError(t, p.Process(underRouter(nil), msg("a")))
	require.True(t, inside.Permanent(tooLong))
	require.False(t, inside.Permanent(errors.New("transient")))
}

func TestDelivery_ReadsWhatWasRecorded(t *testing.T) {
	_, ok := middleware.DeliveryFrom(context.Background())
	require.False(t, ok)
	var zero middleware.Delivery
	_, committed := zero.CommittedAt()
	require.Equal(t, 0, zero.Retries())
	require.False(t, committed)
	before := time.Now()
	ctx, _ := delivery.Start(context.Background(), "orders", time.Now())
	d, ok := middleware.DeliveryFrom(ctx)
	require.True(t, ok)
	require.Equal(t, "orders", d.Handler())
	require.False(t, d.Received().Before(before))
	_, committed = d.CommittedAt()
	require.False(t, committed)

	at := time.Unix(1000, 0)
	delivery.MarkCommitted(ctx, at)
	got, committed := d.CommittedAt()
	require.True(t, committed)
	require.Equal(t, at, got)
	require.Equal(t, 0, d.DeliveriesBegun())
}
