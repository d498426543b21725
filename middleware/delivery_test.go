package middleware_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// A retrying middleware of one's own takes part as Retry does: it records its retries, which
// Metrics counts and Tracing reports, and the processor reads them.
func TestRecordRetry_ACustomRetryIsCountedByMetricsAndTracing(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	metrics, err := middleware.Metrics("h", middleware.WithMeterProvider(mp))
	require.NoError(t, err)
	retryOnce := func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if err := next.Process(ctx, msg); err == nil {
				return nil
			}
			middleware.RecordRetry(ctx)
			return next.Process(ctx, msg)
		})
	}
	var seen []int
	p := middleware.Chain(middleware.Tracing("h", middleware.WithTracerProvider(tp)), metrics, retryOnce)(
		processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
			d, ok := middleware.DeliveryFrom(ctx)
			require.True(t, ok)
			seen = append(seen, d.Retries())
			if d.Retries() == 0 {
				return errors.New("transient")
			}
			return nil
		}))

	require.NoError(t, p.Process(middleware.StartDelivery(context.Background(), "h"), msg("a")))

	require.Equal(t, []int{0, 1}, seen)
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	require.Equal(t, int64(1), sumOf(t, rm, "onceflow.retries", middleware.AttrHandler.String("h")))
	ended := spans.Ended()
	require.Len(t, ended, 1, "outside the router, the consumer span ends when the chain returns")
	require.Equal(t, attribute.IntValue(2), spanAttrs(ended[0])["onceflow.attempts"])
}

func TestDelivery_ReadsWhatWasRecorded(t *testing.T) {
	_, ok := middleware.DeliveryFrom(context.Background())
	require.False(t, ok)
	var zero middleware.Delivery
	_, committed := zero.CommittedAt()
	require.Equal(t, 0, zero.Retries())
	require.False(t, committed)
	middleware.RecordRetry(context.Background()) // no delivery: nothing to record in
	middleware.RecordCommit(context.Background(), time.Now())

	before := time.Now()
	ctx := middleware.StartDelivery(context.Background(), "orders")
	d, ok := middleware.DeliveryFrom(ctx)
	require.True(t, ok)
	require.Equal(t, "orders", d.Handler())
	require.False(t, d.Received().Before(before))
	_, committed = d.CommittedAt()
	require.False(t, committed)

	at := time.Unix(1000, 0)
	middleware.RecordCommit(ctx, at)
	got, committed := d.CommittedAt()
	require.True(t, committed)
	require.Equal(t, at, got)
	require.Equal(t, 0, d.DeliveriesBegun())
}

// The router's delivery takes the consumer span, once; a delivery no router settles does not.
func TestDelivery_HandOverSpanOnlyToTheRouter(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	_, span := tp.Tracer("t").Start(context.Background(), "process t")
	defer span.End()

	routed, _ := middleware.DeliveryFrom(delivery.With(context.Background(), &delivery.State{}))
	require.True(t, routed.HandOverSpan(span))
	require.False(t, routed.HandOverSpan(span), "one consumer span per delivery")

	started, _ := middleware.DeliveryFrom(middleware.StartDelivery(context.Background(), "h"))
	require.False(t, started.HandOverSpan(span))
	var none middleware.Delivery
	require.False(t, none.HandOverSpan(span))
}
