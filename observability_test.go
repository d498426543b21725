package onceflow_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/mem"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// observed is a router fixture whose spans go to a SpanRecorder and whose metrics to a
// ManualReader. Each consumer span is also sent on consumed when it ends: the router ends it
// last, after the acknowledgement, every metric and the log entry of the delivery, so receiving it
// is the synchronisation point of these tests.
type observed struct {
	*fixture
	spans  *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
	reader *sdkmetric.ManualReader
	// meterOptions are given to the MeterProvider beside the reader.
	meterOptions []sdkmetric.Option
	consumed     chan sdktrace.ReadOnlySpan
	logs         *lockedBuffer
}

// consumerSpans sends every consumer span that ends to a channel, after the recorder has it.
type consumerSpans chan sdktrace.ReadOnlySpan

func (c consumerSpans) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (c consumerSpans) OnEnd(s sdktrace.ReadOnlySpan) {
	if s.SpanKind() == trace.SpanKindConsumer {
		c <- s
	}
}
func (c consumerSpans) Shutdown(context.Context) error   { return nil }
func (c consumerSpans) ForceFlush(context.Context) error { return nil }

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

var traceContext = propagation.TraceContext{}

func newObserved(t *testing.T) *observed {
	t.Helper()
	o := &observed{
		fixture:  newFixture(t, testsvc.Databases()[0]), // SQLite
		spans:    tracetest.NewSpanRecorder(),
		reader:   sdkmetric.NewManualReader(),
		consumed: make(chan sdktrace.ReadOnlySpan, 100),
		logs:     &lockedBuffer{},
	}
	o.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(o.spans), sdktrace.WithSpanProcessor(consumerSpans(o.consumed)))
	return o
}

// start runs a router with the fixture's telemetry and handler h, named "effects" on topic
// "orders", until the test ends.
func (o *observed) start(t *testing.T, h onceflow.Handler, register ...func(*onceflow.Router)) {
	t.Helper()
	h.Name = "effects"
	h.Topic = topic
	o.startHandlers(t, register, h)
}

// startHandlers runs a router with the fixture's telemetry and handlers hs until the test ends.
func (o *observed) startHandlers(t *testing.T, register []func(*onceflow.Router), hs ...onceflow.Handler) {
	t.Helper()
	mp := sdkmetric.NewMeterProvider(append([]sdkmetric.Option{sdkmetric.WithReader(o.reader)}, o.meterOptions...)...)
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: o.broker,
		PurgeInterval:       -1,
		CloseTimeout:        5 * time.Second,
		Logger:              slog.New(slog.NewJSONHandler(o.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		TracerProvider:      o.tp,
		MeterProvider:       mp,
		Propagator:          traceContext,
	})
	require.NoError(t, err)
	for _, reg := range register {
		reg(r)
	}
	for _, h := range hs {
		h.DB = o.db
		if h.Subscriber == nil {
			h.Subscriber = o.broker.Subscriber()
		}
		if h.Processor == nil {
			h.Processor = processor.Func(applyEffect)
		}
		h.Retry.InitialInterval = time.Millisecond
		require.NoError(t, r.AddHandler(h))
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

// produce publishes a message as a traced producer would: inside a producer span whose
// context it injects into the headers. It returns that span's context.
func (o *observed) produce(t *testing.T, id, payload string) trace.SpanContext {
	t.Helper()
	ctx, span := o.tp.Tracer("producer").Start(context.Background(), "send "+topic, trace.WithSpanKind(trace.SpanKindProducer))
	m := message.NewMessage(id, []byte(payload))
	traceContext.Inject(ctx, propagation.MapCarrier(m.Metadata))
	span.End()
	require.NoError(t, o.broker.Publish(topic, m))
	return span.SpanContext()
}

// waitDeliveries waits until n deliveries have been settled and their consumer spans ended,
// and returns those spans in order.
func (o *observed) waitDeliveries(t *testing.T, n int) []sdktrace.ReadOnlySpan {
	t.Helper()
	var got []sdktrace.ReadOnlySpan
	timeout := time.After(15 * time.Second)
	for len(got) < n {
		select {
		case s := <-o.consumed:
			got = append(got, s)
		case <-timeout:
			t.Fatalf("%d of %d deliveries settled", len(got), n)
		}
	}
	return got
}

// childrenOf returns the ended spans whose parent is span, by name; a name that occurs more
// than once gets a "#2", "#3"... suffix, in the order the spans ended.
func (o *observed) childrenOf(span sdktrace.ReadOnlySpan) map[string]sdktrace.ReadOnlySpan {
	out := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range o.spans.Ended() {
		if s.Parent().SpanID() != span.SpanContext().SpanID() {
			continue
		}
		name := s.Name()
		for i := 2; out[name] != nil; i++ {
			name = fmt.Sprintf("%s#%d", s.Name(), i)
		}
		out[name] = s
	}
	return out
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

func (o *observed) metrics(t *testing.T) metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, o.reader.Collect(context.Background(), &rm))
	return rm
}

func find(rm metricdata.ResourceMetrics, name string) (metricdata.Metrics, bool) {
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m, true
			}
		}
	}
	return metricdata.Metrics{}, false
}

// counter returns the value of the int64 sum name for exactly the attributes kvs; 0 when there
// is no such data point.
func counter(t *testing.T, rm metricdata.ResourceMetrics, name string, kvs ...attribute.KeyValue) int64 {
	t.Helper()
	m, ok := find(rm, name)
	if !ok {
		return 0
	}
	sum, ok := m.Data.(metricdata.Sum[int64])
	require.True(t, ok, "%s is a %T", name, m.Data)
	want := attribute.NewSet(kvs...)
	for _, dp := range sum.DataPoints {
		if dp.Attributes.Equals(&want) {
			return dp.Value
		}
	}
	return 0
}

// histogramCount returns the number of observations of the histogram name for exactly kvs.
func histogramCount(t *testing.T, rm metricdata.ResourceMetrics, name string, kvs ...attribute.KeyValue) uint64 {
	t.Helper()
	m, ok := find(rm, name)
	if !ok {
		return 0
	}
	h, ok := m.Data.(metricdata.Histogram[float64])
	require.True(t, ok, "%s is a %T", name, m.Data)
	want := attribute.NewSet(kvs...)
	for _, dp := range h.DataPoints {
		if dp.Attributes.Equals(&want) {
			return dp.Count
		}
	}
	return 0
}

// dataPoints counts the data points of name, whatever their attributes.
func dataPoints(rm metricdata.ResourceMetrics, name string) int {
	m, ok := find(rm, name)
	if !ok {
		return 0
	}
	switch d := m.Data.(type) {
	case metricdata.Sum[int64]:
		return len(d.DataPoints)
	case metricdata.Histogram[float64]:
		return len(d.DataPoints)
	case metricdata.Gauge[int64]:
		return len(d.DataPoints)
	case metricdata.Gauge[float64]:
		return len(d.DataPoints)
	}
	return -1
}

var (
	handlerAttr = telemetry.AttrHandler.String("effects")
	outcomeOf   = func(o processor.Outcome) attribute.KeyValue { return telemetry.AttrOutcome.String(string(o)) }
)

// outcomes returns onceflow.messages by outcome for the handler, zero counts left out.
func outcomes(t *testing.T, rm metricdata.ResourceMetrics) map[processor.Outcome]int64 {
	t.Helper()
	got := map[processor.Outcome]int64{}
	for _, o := range []processor.Outcome{processor.Processed, processor.Duplicate, processor.DeadLettered, processor.Failed, processor.Panicked} {
		if n := counter(t, rm, "onceflow.messages", handlerAttr, outcomeOf(o)); n != 0 {
			got[o] = n
		}
	}
	return got
}

func TestTracing_ConsumerSpanContinuesTheProducersTraceWithDedupProcessCommitAndAckChildren(t *testing.T) {
	o := newObserved(t)
	o.start(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, MessagingSystem: "memory"})

	producer := o.produce(t, "m-1", `{"amount":1}`)
	consumer := o.waitDeliveries(t, 1)[0]

	require.Equal(t, "process orders", consumer.Name())
	require.Equal(t, trace.SpanKindConsumer, consumer.SpanKind())
	require.Equal(t, producer.TraceID(), consumer.SpanContext().TraceID())
	require.Equal(t, producer.SpanID(), consumer.Parent().SpanID(), "the parent comes from the traceparent header")
	require.True(t, consumer.Parent().IsRemote())
	require.Equal(t, map[attribute.Key]attribute.Value{
		"messaging.system":            attribute.StringValue("memory"),
		"messaging.destination.name":  attribute.StringValue("orders"),
		"messaging.message.id":        attribute.StringValue("m-1"),
		"messaging.operation.type":    attribute.StringValue("process"),
		"messaging.operation.name":    attribute.StringValue("process"),
		"messaging.message.body.size": attribute.IntValue(12),
		"onceflow.handler":            attribute.StringValue("effects"),
		"onceflow.outcome":            attribute.StringValue("processed"),
		"onceflow.attempts":           attribute.IntValue(1),
	}, attrs(consumer))
	require.Equal(t, codes.Unset, consumer.Status().Code)

	children := o.childrenOf(consumer)
	require.ElementsMatch(t, []string{"onceflow.dedup", "onceflow.process", "onceflow.commit", "ack orders"}, keys(children))
	for name, s := range children {
		kind := trace.SpanKindInternal
		if name == "ack orders" {
			kind = trace.SpanKindClient // a settlement, as the messaging conventions have it
		}
		require.Equal(t, kind, s.SpanKind(), name)
		require.Equal(t, codes.Unset, s.Status().Code, name)
		require.Equal(t, consumer.SpanContext().TraceID(), s.SpanContext().TraceID(), name)
	}
	require.Empty(t, attrs(children["onceflow.dedup"]))
	// Group commit is the default: the message committed in a group of its own.
	require.Equal(t, map[attribute.Key]attribute.Value{"onceflow.group.size": attribute.IntValue(1)}, attrs(children["onceflow.commit"]))
	require.Equal(t, map[attribute.Key]attribute.Value{"onceflow.attempt": attribute.IntValue(1)}, attrs(children["onceflow.process"]))
	require.Equal(t, map[attribute.Key]attribute.Value{
		"messaging.operation.type":   attribute.StringValue("settle"),
		"messaging.operation.name":   attribute.StringValue("ack"),
		"messaging.system":           attribute.StringValue("memory"),
		"messaging.destination.name": attribute.StringValue("orders"),
	}, attrs(children["ack orders"]))

	// The order of a delivery: dedup, then the processor, then the commit, then the ack.
	require.False(t, children["onceflow.process"].StartTime().Before(children["onceflow.dedup"].EndTime()))
	require.False(t, children["onceflow.commit"].StartTime().Before(children["onceflow.process"].EndTime()))
	require.False(t, children["ack orders"].StartTime().Before(children["onceflow.commit"].EndTime()))
	require.False(t, consumer.EndTime().Before(children["ack orders"].EndTime()), "the consumer span ends after the ack")
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestMetrics_SuccessCountsProcessedCommitToAckAndDedupGauges(t *testing.T) {
	o := newObserved(t)
	o.start(t, onceflow.Handler{QoS: onceflow.ExactlyOnce})

	o.produce(t, "m-1", "a")
	o.produce(t, "m-2", "b")
	o.waitDeliveries(t, 2)

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 2}, outcomes(t, rm))
	require.Equal(t, uint64(2), histogramCount(t, rm, "onceflow.process.duration", handlerAttr, outcomeOf(processor.Processed)))
	require.Equal(t, 1, dataPoints(rm, "onceflow.process.duration"))
	require.Equal(t, uint64(2), histogramCount(t, rm, "onceflow.commit_to_ack.duration", handlerAttr))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.inflight", handlerAttr))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.retries", handlerAttr))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.ack.failures", handlerAttr, outcomeOf(processor.Processed)))

	// The dedup gauges read the table at collection time.
	table := []attribute.KeyValue{attribute.String("onceflow.dedup.table", "onceflow_dedup"), attribute.String("db.system.name", "sqlite")}
	rows, ok := find(rm, "onceflow.dedup.rows")
	require.True(t, ok)
	require.Equal(t, []metricdata.DataPoint[int64]{{Attributes: attribute.NewSet(table...), Value: 2}},
		withoutTimes(rows.Data.(metricdata.Gauge[int64]).DataPoints))
	expired, ok := find(rm, "onceflow.dedup.expired")
	require.True(t, ok)
	require.Equal(t, []metricdata.DataPoint[int64]{{Attributes: attribute.NewSet(table...), Value: 0}},
		withoutTimes(expired.Data.(metricdata.Gauge[int64]).DataPoints))
	age, ok := find(rm, "onceflow.dedup.oldest_age")
	require.True(t, ok)
	ages := age.Data.(metricdata.Gauge[float64]).DataPoints
	require.Len(t, ages, 1)
	want := attribute.NewSet(table...)
	require.True(t, ages[0].Attributes.Equals(&want))
	require.GreaterOrEqual(t, ages[0].Value, 0.0)
	require.Less(t, ages[0].Value, 60.0)
	require.Equal(t, "s", age.Unit)
}

// The dedup gauges read their table at each collection; a View that drops them takes them out
// of the collection, and the other metrics stay (docs/observability.md shows the View).
func TestMetrics_AViewDropsTheDedupGauges(t *testing.T) {
	o := newObserved(t)
	o.meterOptions = []sdkmetric.Option{
		sdkmetric.WithView(sdkmetric.NewView(sdkmetric.Instrument{Name: "onceflow.dedup.*"}, sdkmetric.Stream{Aggregation: sdkmetric.AggregationDrop{}})),
	}
	o.start(t, onceflow.Handler{QoS: onceflow.ExactlyOnce})
	o.produce(t, "m-1", "a")
	o.waitDeliveries(t, 1)

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 1}, outcomes(t, rm))
	for _, name := range []string{"onceflow.dedup.rows", "onceflow.dedup.expired", "onceflow.dedup.oldest_age"} {
		_, ok := find(rm, name)
		require.False(t, ok, "%s is dropped", name)
	}
}

func TestMetrics_GroupSizeCountsTheMessagesEachGroupCommitted(t *testing.T) {
	o := newObserved(t)
	o.start(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, GroupCommit: onceflow.GroupCommitConfig{}})

	for i := range 5 {
		o.produce(t, fmt.Sprintf("g-%d", i), "x")
	}
	o.produce(t, "g-0", "x") // a copy: acknowledged, its effect not committed again
	o.waitDeliveries(t, 6)

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 5, processor.Duplicate: 1}, outcomes(t, rm))
	m, ok := find(rm, "onceflow.group.size")
	require.True(t, ok)
	require.Equal(t, "{message}", m.Unit)
	h, ok := m.Data.(metricdata.Histogram[int64])
	require.True(t, ok, "onceflow.group.size is a %T", m.Data)
	require.Len(t, h.DataPoints, 1)
	dp := h.DataPoints[0]
	want := attribute.NewSet(handlerAttr)
	require.True(t, dp.Attributes.Equals(&want), "attributes %v", dp.Attributes.ToSlice())
	require.Equal(t, int64(5), dp.Sum, "each committed message once, the copy not")
	require.GreaterOrEqual(t, dp.Count, uint64(1))
	require.LessOrEqual(t, dp.Count, uint64(5), "one record per committed transaction")
}

func withoutTimes[N int64 | float64](dps []metricdata.DataPoint[N]) []metricdata.DataPoint[N] {
	out := make([]metricdata.DataPoint[N], len(dps))
	for i, dp := range dps {
		out[i] = metricdata.DataPoint[N]{Attributes: dp.Attributes, Value: dp.Value}
	}
	return out
}

func TestMetrics_DuplicateIsCountedAndAckedWithoutCommit(t *testing.T) {
	o := newObserved(t)
	o.start(t, onceflow.Handler{QoS: onceflow.ExactlyOnce})

	o.produce(t, "m-1", "a")
	o.waitDeliveries(t, 1)
	o.produce(t, "m-1", "a") // the broker delivers it again
	spans := o.waitDeliveries(t, 1)

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 1, processor.Duplicate: 1}, outcomes(t, rm))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.process.duration", handlerAttr, outcomeOf(processor.Duplicate)))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.commit_to_ack.duration", handlerAttr), "a duplicate commits nothing")
	require.Equal(t, int64(0), counter(t, rm, "onceflow.inflight", handlerAttr))
	o.waitAcks(t, "m-1", 2) // the broker counts acks on its own goroutine
	require.Equal(t, 2, o.broker.Acks("m-1"))
	require.Equal(t, 1, countEffects(t, o.db, "m-1"))

	dup := spans[0]
	require.Equal(t, attribute.StringValue("duplicate"), attrs(dup)["onceflow.outcome"])
	require.Equal(t, codes.Unset, dup.Status().Code, "a duplicate is not an error")
	require.ElementsMatch(t, []string{"onceflow.dedup", "ack orders"}, keys(o.childrenOf(dup)),
		"the processor does not run and nothing commits")
}

func TestMetrics_FailureIsNackedCountedAndRecordedAsAnError(t *testing.T) {
	o := newObserved(t)
	var calls atomic.Int32
	o.start(t, onceflow.Handler{
		QoS:   onceflow.ExactlyOnce,
		Retry: middleware.Retry{MaxAttempts: 2},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if calls.Add(1) <= 2 { // both attempts of the first delivery
				return errors.New("inventory service unavailable")
			}
			return applyEffect(ctx, msg)
		}),
	})

	o.produce(t, "m-1", "a")
	spans := o.waitDeliveries(t, 2) // the failed delivery, then the broker's redelivery

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Failed: 1, processor.Processed: 1}, outcomes(t, rm))
	require.Equal(t, int64(1), counter(t, rm, "onceflow.retries", handlerAttr))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.process.duration", handlerAttr, outcomeOf(processor.Failed)))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.process.duration", handlerAttr, outcomeOf(processor.Processed)))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.commit_to_ack.duration", handlerAttr))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.inflight", handlerAttr))
	o.waitAcks(t, "m-1", 1) // the broker counts acks on its own goroutine
	require.Equal(t, 1, o.broker.Nacks("m-1"))
	require.Equal(t, 1, o.broker.Acks("m-1"))

	failed := spans[0]
	require.Equal(t, codes.Error, failed.Status().Code)
	require.Equal(t, "inventory service unavailable", failed.Status().Description)
	a := attrs(failed)
	require.Equal(t, attribute.StringValue("failed"), a["onceflow.outcome"])
	require.Equal(t, attribute.StringValue("failed"), a["error.type"])
	require.Equal(t, attribute.IntValue(2), a["onceflow.attempts"])
	require.Equal(t, "exception", failed.Events()[0].Name)

	children := o.childrenOf(failed)
	require.ElementsMatch(t, []string{"onceflow.dedup", "onceflow.dedup#2", "onceflow.process", "onceflow.process#2", "nack orders"}, keys(children),
		"one dedup and one process span per attempt, no commit")
	require.Equal(t, attribute.IntValue(1), attrs(children["onceflow.process"])["onceflow.attempt"])
	require.Equal(t, attribute.IntValue(2), attrs(children["onceflow.process#2"])["onceflow.attempt"])
	require.Equal(t, codes.Error, children["onceflow.process"].Status().Code)
	require.Equal(t, codes.Error, children["onceflow.process#2"].Status().Code)
	require.Equal(t, attribute.StringValue("nack"), attrs(children["nack orders"])["messaging.operation.name"])

	redelivered := spans[1]
	require.Equal(t, codes.Unset, redelivered.Status().Code)
	require.Equal(t, failed.Parent().SpanID(), redelivered.Parent().SpanID(), "both deliveries continue the producer's trace")
}

func TestMetrics_RetryThenSuccessIsProcessedWithOneRetry(t *testing.T) {
	o := newObserved(t)
	var calls atomic.Int32
	o.start(t, onceflow.Handler{
		QoS:   onceflow.ExactlyOnce,
		Retry: middleware.Retry{MaxAttempts: 3},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if err := applyEffect(ctx, msg); err != nil {
				return err
			}
			if calls.Add(1) == 1 {
				return errors.New("deadlock detected")
			}
			return nil
		}),
	})

	o.produce(t, "m-1", "a")
	consumer := o.waitDeliveries(t, 1)[0]

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 1}, outcomes(t, rm), "a retry is not an outcome")
	require.Equal(t, int64(1), counter(t, rm, "onceflow.retries", handlerAttr))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.process.duration", handlerAttr, outcomeOf(processor.Processed)))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.commit_to_ack.duration", handlerAttr))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.inflight", handlerAttr))
	require.Equal(t, 0, o.broker.Nacks("m-1"))
	require.Equal(t, 1, countEffects(t, o.db, "m-1"))

	require.Equal(t, codes.Unset, consumer.Status().Code)
	require.Equal(t, attribute.IntValue(2), attrs(consumer)["onceflow.attempts"])
	children := o.childrenOf(consumer)
	require.ElementsMatch(t, []string{"onceflow.dedup", "onceflow.dedup#2", "onceflow.process", "onceflow.process#2", "onceflow.commit", "ack orders"}, keys(children))
	require.Equal(t, codes.Error, children["onceflow.process"].Status().Code)
	require.Equal(t, codes.Unset, children["onceflow.process#2"].Status().Code)
}

func TestMetrics_DeadLetterIsCountedAndTheDeadLetterContinuesTheTrace(t *testing.T) {
	o := newObserved(t)
	o.start(t, onceflow.Handler{
		QoS: onceflow.ExactlyOnce,
		Processor: processor.Func(func(context.Context, *messagedata.MessageData) error {
			return processor.Permanent(errors.New("amount is negative"))
		}),
	})

	o.produce(t, "m-1", "a")
	consumer := o.waitDeliveries(t, 1)[0]

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.DeadLettered: 1}, outcomes(t, rm))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.process.duration", handlerAttr, outcomeOf(processor.DeadLettered)))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.retries", handlerAttr), "a permanent error is not retried")
	require.Equal(t, 0, dataPoints(rm, "onceflow.commit_to_ack.duration"))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.inflight", handlerAttr))
	o.waitAcks(t, "m-1", 1)
	require.Equal(t, 1, o.broker.Acks("m-1"))

	require.Equal(t, codes.Error, consumer.Status().Code)
	require.Equal(t, attribute.StringValue("dead_lettered"), attrs(consumer)["error.type"])
	require.Equal(t, attribute.StringValue("ack"), attrs(o.childrenOf(consumer)["ack orders"])["messaging.operation.name"])

	dead := o.broker.Drain(onceflow.DefaultDeadLetterTopic)
	require.Len(t, dead, 1)
	parent := trace.SpanContextFromContext(traceContext.Extract(context.Background(), propagation.MapCarrier(dead[0].Metadata)))
	require.Equal(t, consumer.SpanContext().TraceID(), parent.TraceID())
	send := o.childrenOf(consumer)["send "+onceflow.DefaultDeadLetterTopic]
	require.NotNil(t, send, "the dead letter is sent under a producer span of the failed delivery")
	require.Equal(t, trace.SpanKindProducer, send.SpanKind())
	require.Equal(t, send.SpanContext().SpanID(), parent.SpanID(), "the dead letter's parent is its send span")
}

// expiringSubscriber gives each delivery a context that the test ends, as a subscriber does
// when the ack deadline passes or the subscription closes while the message is processed.
type expiringSubscriber struct {
	message.Subscriber
	cancels sync.Map // message UUID -> context.CancelFunc
}

func (s *expiringSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for m := range in {
			mctx, cancel := context.WithCancel(m.Context())
			m.SetContext(mctx)
			s.cancels.Store(m.UUID, cancel)
			out <- m
		}
	}()
	return out, nil
}

func TestMetrics_AckAfterTheDeliveryEndedIsCountedAsAnAckFailure(t *testing.T) {
	o := newObserved(t)
	sub := &expiringSubscriber{Subscriber: o.broker.Subscriber()}
	// Outermost: the delivery ends after the commit, before the router acknowledges.
	expire := onceflow.Use("expire", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			if cancel, ok := sub.cancels.Load(msg.ID); ok {
				cancel.(context.CancelFunc)()
			}
			return err
		})
	})
	o.start(t, onceflow.Handler{
		Subscriber: sub,
		Chain:      onceflow.ExactlyOnce.Chain().Before(onceflow.StageTracing, expire),
	})

	o.produce(t, "m-1", "a")
	consumer := o.waitDeliveries(t, 1)[0]

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 1}, outcomes(t, rm))
	require.Equal(t, int64(1), counter(t, rm, "onceflow.ack.failures", handlerAttr, outcomeOf(processor.Processed)))
	require.Equal(t, 0, dataPoints(rm, "onceflow.commit_to_ack.duration"), "no latency for an ack that did not reach the subscriber")
	require.Equal(t, 1, countEffects(t, o.db, "m-1"), "the commit stands")

	ack := o.childrenOf(consumer)["ack orders"]
	require.Equal(t, codes.Error, ack.Status().Code)
	require.Contains(t, ack.Status().Description, onceflow.ErrAckLost.Error())
	require.Contains(t, o.logs.String(), `"msg":"acknowledgement lost; the broker will deliver the message again"`)
}

func TestLogs_CarryHandlerMessageIDAndAttemptAndNeverThePayload(t *testing.T) {
	o := newObserved(t)
	const secret = "card=4111111111111111"
	var calls atomic.Int32
	o.start(t, onceflow.Handler{
		QoS:   onceflow.ExactlyOnce,
		Retry: middleware.Retry{MaxAttempts: 2},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			switch msg.ID {
			case "bad":
				return processor.Permanent(errors.New("amount is negative"))
			case "flaky":
				if calls.Add(1) <= 2 {
					return errors.New("inventory service unavailable")
				}
			}
			return applyEffect(ctx, msg)
		}),
	})

	for _, id := range []string{"good", "bad", "flaky"} {
		o.produce(t, id, `{"`+secret+`"}`)
	}
	o.waitDeliveries(t, 4) // flaky fails once, is nacked, and is delivered again
	// The router logs a delivery's outcome after its acknowledgement: good and flaky processed,
	// bad dead-lettered.
	testsvc.Eventually(t, 5*time.Second, func() bool {
		logs := o.logs.String()
		return strings.Count(logs, `"msg":"message processed"`) == 2 && strings.Contains(logs, `"msg":"message dead-lettered"`)
	}, "the outcomes of good, bad and flaky were not all logged")

	var records []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(o.logs.String()), "\n") {
		require.NotContains(t, line, secret, "no payload in any log entry, at any level")
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		records = append(records, rec)
	}

	// The router's entries about a delivery, by message id and level.
	type entry struct{ id, level, msg string }
	var got []entry
	for _, rec := range records {
		id, ok := rec["message_id"].(string)
		if !ok {
			continue
		}
		require.Equal(t, "effects", rec["handler"], rec)
		require.Contains(t, rec, "attempt", rec)
		got = append(got, entry{id, rec["level"].(string), rec["msg"].(string)})
	}
	require.Contains(t, got, entry{"good", "DEBUG", "message processed"})
	require.Contains(t, got, entry{"bad", "WARN", "message dead-lettered"})
	require.Contains(t, got, entry{"flaky", "WARN", "message processing failed"})
	require.Contains(t, got, entry{"flaky", "DEBUG", "message processed"})
	for _, rec := range records {
		if rec["message_id"] == "flaky" && rec["level"] == "WARN" {
			require.Equal(t, float64(2), rec["attempt"], "the failure is logged after the last attempt")
		}
	}

	// At info level, the default, a processed message writes nothing.
	for _, e := range got {
		if e.id == "good" {
			require.Equal(t, "DEBUG", e.level)
		}
	}
}

func TestLogsAndDeadLetter_SayTheSameDeliveryAndAttempt(t *testing.T) {
	o := newObserved(t)
	o.start(t, onceflow.Handler{
		QoS:        onceflow.ExactlyOnce,
		Retry:      middleware.Retry{MaxAttempts: 3},
		DeadLetter: middleware.DeadLetter{MaxDeliveries: 2},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			return errors.New("inventory service unavailable")
		}),
	})
	o.produce(t, "stubborn", "x")
	o.waitAcks(t, "stubborn", 1)
	require.Equal(t, 1, o.broker.Nacks("stubborn"), "nacked at the first delivery, given up at the second")

	// The router logs a delivery's outcome after its acknowledgement.
	var logged map[string]any
	for deadline := time.Now().Add(5 * time.Second); logged == nil && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		for _, line := range strings.Split(strings.TrimSpace(o.logs.String()), "\n") {
			var rec map[string]any
			require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
			if rec["msg"] == "message dead-lettered" {
				logged = rec
			}
		}
	}
	require.NotNil(t, logged, o.logs.String())
	require.Equal(t, float64(3), logged["attempt"])
	require.Equal(t, float64(2), logged["delivery"])
	dead := o.deadLetters()
	require.Len(t, dead, 1)
	require.Equal(t, "3", dead[0].Metadata.Get(messagedata.HeaderDeadLetterAttempt), "the attempt the log says")
	require.Equal(t, "2", dead[0].Metadata.Get(messagedata.HeaderDeadLetterDeliveries), "the delivery the log says")
}

// The same trace, metrics and ack on the embedded SQLite queue, whose deliveries run in a
// transaction of the queue file and whose acknowledgement commits the consumer group's offset.
func TestTracing_OnTheEmbeddedQueueTheTraceContinuesAndTheAckIsRecorded(t *testing.T) {
	o := newObserved(t)
	q, err := sqlitequeue.Open(context.Background(), "sqlite://"+filepath.Join(t.TempDir(), "queue.db"), sqlitequeue.Config{ConsumerGroup: "effects"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = q.Close() })
	sub, err := q.Subscriber()
	require.NoError(t, err)
	o.start(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, Subscriber: sub, MessagingSystem: "sqlite"})

	ctx, span := o.tp.Tracer("producer").Start(context.Background(), "send "+topic, trace.WithSpanKind(trace.SpanKindProducer))
	m := message.NewMessage("m-1", []byte("a"))
	traceContext.Inject(ctx, propagation.MapCarrier(m.Metadata))
	span.End()
	require.NoError(t, q.Publisher().Publish(topic, m))

	consumer := o.waitDeliveries(t, 1)[0]
	require.Equal(t, span.SpanContext().SpanID(), consumer.Parent().SpanID())
	require.Equal(t, attribute.StringValue("sqlite"), attrs(consumer)["messaging.system"])
	require.ElementsMatch(t, []string{"onceflow.dedup", "onceflow.process", "onceflow.commit", "ack orders"}, keys(o.childrenOf(consumer)))

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 1}, outcomes(t, rm))
	require.Equal(t, uint64(1), histogramCount(t, rm, "onceflow.commit_to_ack.duration", handlerAttr))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.ack.failures", handlerAttr, outcomeOf(processor.Processed)))
	testsvc.Eventually(t, 10*time.Second, func() bool {
		n, err := q.Backlog(context.Background(), topic, "effects")
		return err == nil && n == 0
	}, "the acknowledgement did not commit the consumer group's offset")
}

func TestTelemetry_FollowsTheMessagingConventionsWithTheBrokersNameAndGroup(t *testing.T) {
	o := newObserved(t)
	b, err := broker.Open(context.Background(), "mem://conventions?group=billing", broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	sub, err := b.Subscriber()
	require.NoError(t, err)
	o.start(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, Subscriber: sub})
	require.NoError(t, b.Publisher().Publish(topic, message.NewMessage("m-1", []byte("a"))))

	consumer := o.waitDeliveries(t, 1)[0]
	a := attrs(consumer)
	require.Equal(t, attribute.StringValue("mem"), a["messaging.system"], "the broker's name, never onceflow")
	require.Equal(t, attribute.StringValue("billing"), a["messaging.consumer.group.name"], "the broker's consumer group")
	require.Equal(t, attribute.StringValue("effects"), a["onceflow.handler"])
	require.Equal(t, "github.com/onceflow/onceflow", consumer.InstrumentationScope().Name)
	require.Equal(t, semconv.SchemaURL, consumer.InstrumentationScope().SchemaURL)
	ack := o.childrenOf(consumer)["ack "+topic]
	require.NotNil(t, ack)
	require.Equal(t, trace.SpanKindClient, ack.SpanKind())
	require.Equal(t, attribute.StringValue("billing"), attrs(ack)["messaging.consumer.group.name"])

	rm := o.metrics(t)
	want := attribute.NewSet(attribute.String("messaging.system", "mem"), attribute.String("messaging.destination.name", topic),
		attribute.String("messaging.consumer.group.name", "billing"), attribute.String("messaging.operation.name", "process"))
	var consumed int64
	var durations uint64
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, semconv.SchemaURL, sm.Scope.SchemaURL, sm.Scope.Name)
		for _, m := range sm.Metrics {
			switch m.Name {
			case "messaging.client.consumed.messages":
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					if dp.Attributes.Equals(&want) {
						consumed += dp.Value
					}
				}
			case "messaging.process.duration":
				for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
					if dp.Attributes.Equals(&want) {
						durations += dp.Count
					}
				}
			}
		}
	}
	require.Equal(t, int64(1), consumed)
	require.Equal(t, uint64(1), durations)
}
