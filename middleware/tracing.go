package middleware

import (
	"context"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// Attribute keys that onceflow adds to the OpenTelemetry semantic conventions, on its spans
// and metrics. docs/observability.md lists where each appears.
const (
	// AttrHandler is the handler name.
	AttrHandler = telemetry.AttrHandler
	// AttrOutcome is the processor.Outcome of the delivery.
	AttrOutcome = telemetry.AttrOutcome
	// AttrAttempts is the number of processing attempts the delivery took.
	AttrAttempts = telemetry.AttrAttempts
)

// DefaultMessagingSystem is the messaging.system attribute when WithMessagingSystem is not
// given: the framework the messages come through, when the broker is not known.
const DefaultMessagingSystem = "watermill"

// TracingOption configures Tracing.
type TracingOption interface{ applyTracing(*tracingConfig) }

type tracingConfig struct {
	provider   trace.TracerProvider
	propagator propagation.TextMapPropagator
	messaging  messagingConfig
}

type tracingOptionFunc func(*tracingConfig)

func (f tracingOptionFunc) applyTracing(c *tracingConfig) { f(c) }

// messagingConfig is what Tracing and Metrics say of the broker, in the messaging semantic
// conventions' attributes.
type messagingConfig struct {
	system, group string
}

// attrs returns messaging.system and, when known, messaging.consumer.group.name.
func (m messagingConfig) attrs() []attribute.KeyValue {
	a := []attribute.KeyValue{semconv.MessagingSystemKey.String(m.system)}
	if m.group != "" {
		a = append(a, semconv.MessagingConsumerGroupName(m.group))
	}
	return a
}

// MessagingOption describes the broker to both Tracing and Metrics.
type MessagingOption interface {
	TracingOption
	MetricsOption
}

type messagingOptionFunc func(*messagingConfig)

func (f messagingOptionFunc) applyTracing(c *tracingConfig) { f(&c.messaging) }
func (f messagingOptionFunc) applyMetrics(c *metricsConfig) { f(&c.messaging) }

// WithTracerProvider sets the TracerProvider. Defaults to the global provider
// (otel.GetTracerProvider), read when the middleware is applied to a processor.
func WithTracerProvider(tp trace.TracerProvider) TracingOption {
	return tracingOptionFunc(func(c *tracingConfig) { c.provider = tp })
}

// WithPropagator sets the propagator that reads the parent context from message headers and
// that the middlewares inside use to write it into the messages they publish (DeadLetter).
// Defaults to the global propagator (otel.GetTextMapPropagator), which propagates nothing until
// the application sets one, for instance with
// otel.SetTextMapPropagator(propagation.TraceContext{}).
func WithPropagator(p propagation.TextMapPropagator) TracingOption {
	return tracingOptionFunc(func(c *tracingConfig) { c.propagator = p })
}

// WithMessagingSystem sets the messaging.system attribute of spans and semantic-convention
// metrics: the broker, such as "rabbitmq", "nats", "redis", "postgresql", "mysql" or "sqlite".
// Defaults to DefaultMessagingSystem.
func WithMessagingSystem(system string) MessagingOption {
	return messagingOptionFunc(func(c *messagingConfig) { c.system = system })
}

// WithConsumerGroup sets the messaging.consumer.group.name attribute: the broker's consumer
// group the handler consumes in. Without it the attribute is left out; the handler's name is
// in onceflow.handler either way.
func WithConsumerGroup(group string) MessagingOption {
	return messagingOptionFunc(func(c *messagingConfig) { c.group = group })
}

// Tracing starts one consumer span per message, following the OpenTelemetry messaging
// semantic conventions: named "process <topic>", kind consumer, with messaging.system (the
// broker, WithMessagingSystem), messaging.destination.name, messaging.message.id,
// messaging.operation.type and .name ("process"), messaging.consumer.group.name (the broker's
// consumer group, WithConsumerGroup) and messaging.message.body.size, plus onceflow.handler,
// and when the chain returns onceflow.outcome and onceflow.attempts. The instrumentation scope
// is github.com/onceflow/onceflow with the module's version and the conventions' schema URL.
//
// The parent is the context that the producer injected into the message headers (W3C
// traceparent), so a trace continues across brokers and across the outbox relay. A failed,
// panicked or dead-lettered outcome records the error, sets error.type to the outcome and the
// status to Error; processed and duplicate leave the status unset. The middlewares inside add
// child spans: onceflow.dedup (Deduplicate), onceflow.commit (Transaction), and under the router
// onceflow.process around the processor. DeadLetter writes the context of this span into the
// dead-lettered message, so its consumers continue the trace.
//
// Under the router, the consumer span ends after the acknowledgement, which the router records
// as the child span "ack <topic>" or "nack <topic>" (kind client); elsewhere it ends when the
// chain returns. A dead letter gets a producer span "send <dead-letter topic>" (DeadLetter).
//
// The attributes that are the same for all messages of a topic (system, destination,
// operation, consumer group, handler) are given at span start, so samplers see them, from
// options built once per topic; the others are set when the chain returns, and only when the
// span is recording: with no SDK installed, or a sampled-out trace, nothing is built.
func Tracing(handler string, opts ...TracingOption) Middleware {
	return Observe(TracingObserver(handler, opts...))
}

// TracingObserver returns the Observer that Tracing is made of: Begin starts the consumer span
// and End sets the attributes of the outcome and ends it, or leaves it to the router.
func TracingObserver(handler string, opts ...TracingOption) Observer {
	cfg := tracingConfig{messaging: messagingConfig{system: DefaultMessagingSystem}}
	for _, o := range opts {
		o.applyTracing(&cfg)
	}
	provider := cfg.provider
	if provider == nil {
		provider = otel.GetTracerProvider()
	}
	// The attributes that are the same for every message of a topic are given at span start,
	// where samplers see them, in options built once per topic.
	static := append(cfg.messaging.attrs(),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		AttrHandler.String(handler),
	)
	return &tracingObserver{tracer: telemetry.Tracer(provider), propagator: cfg.propagator, starts: &spanStarts{static: static}}
}

type tracingObserver struct {
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	starts     *spanStarts
}

func (o *tracingObserver) Begin(ctx context.Context, msg *messagedata.MessageData) context.Context {
	prop := o.propagator
	if prop == nil {
		prop = otel.GetTextMapPropagator()
	} else {
		// Only a configured propagator travels in the context: the middlewares inside fall
		// back to the global one by themselves.
		ctx = telemetry.WithPropagator(ctx, prop)
	}
	ctx = prop.Extract(ctx, telemetry.HeaderCarrier(msg.Headers))
	start := o.starts.get(msg.Topic)
	ctx, span := o.tracer.Start(ctx, start.name, start.opts...)
	// Under the router, which acknowledges after the chain returns, the span is the router's
	// to end: it records the ack as a child span first.
	if d, _ := DeliveryFrom(ctx); !d.HandOverSpan(span) && span.IsRecording() {
		return ownSpan{ctx}
	}
	return ctx
}

// ownSpan is the context of a recording consumer span that no router ends: End ends it. (Ending
// a span that does not record does nothing.)
type ownSpan struct{ context.Context }

func (o *tracingObserver) End(ctx context.Context, msg *messagedata.MessageData, err error) {
	span := trace.SpanFromContext(ctx)
	if span.IsRecording() {
		d, started := DeliveryFrom(ctx)
		setAttributes(span, msg, d, started, err)
	}
	if _, own := ctx.(ownSpan); own {
		span.End()
	}
}

// setAttributes sets the attributes of the consumer span that vary by message, in one call.
func setAttributes(span trace.Span, msg *messagedata.MessageData, d Delivery, started bool, err error) {
	outcome := processor.OutcomeOf(err)
	attrs := make([]attribute.KeyValue, 0, 5)
	attrs = append(attrs,
		semconv.MessagingMessageID(msg.ID),
		semconv.MessagingMessageBodySize(len(msg.Payload)),
		AttrOutcome.String(string(outcome)),
	)
	if started {
		attrs = append(attrs, AttrAttempts.Int(d.Retries()+1))
	}
	if outcome == processor.Failed || outcome == processor.Panicked || outcome == processor.DeadLettered {
		attrs = append(attrs, semconv.ErrorTypeKey.String(string(outcome)))
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.SetAttributes(attrs...)
}

// spanStarts caches the name ("process <topic>") and start options of the consumer span for
// the topic a handler consumes, so that starting a span allocates nothing of ours.
type spanStarts struct {
	static []attribute.KeyValue
	cached atomic.Pointer[spanStart]
}

type spanStart struct {
	topic, name string
	opts        []trace.SpanStartOption
}

func (c *spanStarts) get(topic string) *spanStart {
	if s := c.cached.Load(); s != nil && s.topic == topic {
		return s
	}
	attrs := append(append(make([]attribute.KeyValue, 0, len(c.static)+1), c.static...), semconv.MessagingDestinationName(topic))
	s := &spanStart{topic: topic, name: "process " + topic, opts: []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...),
	}}
	c.cached.Store(s)
	return s
}
