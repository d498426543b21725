package middleware

import (
	"cmp"
	"context"
	"reflect"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// DefaultMessagingSystem is the messaging.system attribute when MessagingSystem is not
// given: the framework the messages come through, when the broker is not known.
const DefaultMessagingSystem = "watermill"

// messagingConfig is what Tracing and Metrics say of the broker, in the messaging semantic
// conventions' attributes.
type messagingConfig struct {
	system, group string
}

// messaging returns the messaging attributes of system and group, system defaulting to
// DefaultMessagingSystem.
func messaging(system, group string) messagingConfig {
	return messagingConfig{system: cmp.Or(system, DefaultMessagingSystem), group: group}
}

// attrs returns messaging.system and, when known, messaging.consumer.group.name.
func (m messagingConfig) attrs() []attribute.KeyValue {
	a := []attribute.KeyValue{semconv.MessagingSystemKey.String(m.system)}
	if m.group != "" {
		a = append(a, semconv.MessagingConsumerGroupName(m.group))
	}
	return a
}

// Tracing configures the tracing stage: one consumer span per message, following the
// OpenTelemetry messaging semantic conventions, named "process <topic>", kind consumer, with
// messaging.system (the broker, MessagingSystem), messaging.destination.name,
// messaging.message.id, messaging.operation.type and .name ("process"),
// messaging.consumer.group.name (ConsumerGroup) and messaging.message.body.size, plus
// onceflow.handler, and when the chain returns onceflow.outcome and onceflow.attempts. The
// instrumentation scope is github.com/onceflow/onceflow with the module's version and the
// conventions' schema URL. The zero value is the default configuration.
//
// The parent is the context that the producer injected into the message headers (W3C
// traceparent), so a trace continues across brokers and across the outbox relay. A failed,
// panicked or dead-lettered outcome records the error, sets error.type to the outcome and the
// status to Error; processed and duplicate leave the status unset. The stages inside add child
// spans: onceflow.dedup (duplicate detection), onceflow.commit (the transaction), and under the
// router onceflow.process around the processor. The dead-letter stage writes the context of this
// span into the dead-lettered message, so its consumers continue the trace.
//
// Under the router, the consumer span ends after the acknowledgement, which the router records
// as the child span "ack <topic>" or "nack <topic>" (kind client); elsewhere it ends when the
// chain returns. A dead letter gets a producer span "send <dead-letter topic>".
//
// The attributes that are the same for all messages of a topic (system, destination,
// operation, consumer group, handler) are given at span start, so samplers see them, from
// options built once per topic; the others are set when the chain returns, and only when the
// span is recording: with no SDK installed, or a sampled-out trace, nothing is built. With the
// no-op provider (trace/noop), or the global one while no provider is set, whose spans would
// record nothing and carry their parent's span context, no consumer span is started at all:
// the chain sees the parent's trace context, as it would through such a span.
type Tracing struct {
	// TracerProvider provides the tracer. Defaults to the global provider
	// (otel.GetTracerProvider), read when the stage is applied to a processor.
	TracerProvider trace.TracerProvider
	// Propagator reads the parent context from message headers, and the stages inside use it
	// to write it into the messages they publish (DeadLetter). Defaults to the global
	// propagator (otel.GetTextMapPropagator), which propagates nothing until the application
	// sets one, for instance with otel.SetTextMapPropagator(propagation.TraceContext{}).
	Propagator propagation.TextMapPropagator
	// MessagingSystem is the messaging.system attribute: the broker, such as "rabbitmq",
	// "nats", "redis", "postgresql", "mysql" or "sqlite". Defaults to DefaultMessagingSystem.
	MessagingSystem string
	// ConsumerGroup is the messaging.consumer.group.name attribute: the broker's consumer group
	// the handler consumes in. Left out when empty; the handler's name is in onceflow.handler
	// either way.
	ConsumerGroup string
}

// Middleware returns the tracing stage of t for handler: Observe of its Observer.
func (t Tracing) Middleware(handler string) Middleware { return Observe(t.Observer(handler)) }

// Observer returns the Observer the tracing stage of t for handler is made of: Begin starts the
// consumer span and End sets the attributes of the outcome and ends it, or leaves it to the
// router.
func (t Tracing) Observer(handler string) Observer {
	provider := t.TracerProvider
	if provider == nil {
		provider = otel.GetTracerProvider()
	}
	// The attributes that are the same for every message of a topic are given at span start,
	// where samplers see them, in options built once per topic.
	static := append(messaging(t.MessagingSystem, t.ConsumerGroup).attrs(),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		telemetry.AttrHandler.String(handler),
	)
	tracer := telemetry.Tracer(provider)
	return &tracingObserver{
		tracer: tracer, propagator: t.Propagator, starts: &spanStarts{static: static},
		provider: provider, idle: idleOf(provider, tracer),
	}
}

type tracingObserver struct {
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	starts     *spanStarts
	provider   trace.TracerProvider
	idle       idleTracer
}

// idleTracer tells whether a tracer is idle: one whose spans record nothing and carry their
// parent's span context, so that a context holding one of its spans in place of a parent that
// records nothing tells every reader (child spans, propagation into outgoing messages, the
// router's settle span) what the parent alone tells. Starting such a span only allocates.
type idleTracer int

const (
	// idleNever: the tracer may record, or mint span ids.
	idleNever idleTracer = iota
	// idleAlways: the tracer is the OpenTelemetry no-op tracer (trace/noop).
	idleAlways
	// idleWhileGlobalUnset: the tracer is OpenTelemetry's global tracer with no provider set,
	// idle until otel.SetTracerProvider gives it a provider to delegate to.
	idleWhileGlobalUnset
)

// idleOf returns how tracer, provider's, is idle. The global tracer is tried once, with a span
// that is never ended: it may record even with no provider set (the Go auto-instrumentation
// makes it), and then it is never taken for idle.
func idleOf(provider trace.TracerProvider, tracer trace.Tracer) idleTracer {
	if _, ok := provider.(noop.TracerProvider); ok {
		return idleAlways
	}
	if reflect.TypeOf(provider).String() != "*global.tracerProvider" || provider != otel.GetTracerProvider() {
		return idleNever
	}
	if _, span := tracer.Start(context.Background(), "onceflow.probe"); span.IsRecording() {
		return idleNever
	}
	return idleWhileGlobalUnset
}

// skips reports whether the consumer span of a delivery whose context is parent need not be
// started: the tracer is idle, and parent's span records nothing.
func (o *tracingObserver) skips(parent context.Context) bool {
	switch o.idle {
	case idleNever:
		return false
	case idleWhileGlobalUnset:
		if otel.GetTracerProvider() != o.provider {
			return false // a provider was set: the global tracer delegates to it now
		}
	}
	return !trace.SpanFromContext(parent).IsRecording()
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
	if o.skips(ctx) {
		return ctx
	}
	start := o.starts.get(msg.Topic)
	ctx, span := o.tracer.Start(ctx, start.name, start.opts...)
	// Under the router, which acknowledges after the chain returns, the span is the router's
	// to end: it records the ack as a child span first.
	if !delivery.HandOverSpan(delivery.From(ctx), span) && span.IsRecording() {
		return ownSpan{ctx}
	}
	return ctx
}

// ownSpan is the context of a recording consumer span that no router ends: End ends it. (Ending
// a span that does not record does nothing.)
type ownSpan struct{ context.Context }

func (o *tracingObserver) End(ctx context.Context, msg *messagedata.MessageData, err error) {
	_, own := ctx.(ownSpan)
	if st := delivery.From(ctx); !own && st != nil && st.Span == nil {
		return // Begin started no span: it skipped, and the span around does not record
	}
	span := trace.SpanFromContext(ctx)
	if span.IsRecording() {
		d, started := DeliveryFrom(ctx)
		setAttributes(span, msg, d, started, err)
	}
	if own {
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
		telemetry.AttrOutcome.String(string(outcome)),
	)
	if started {
		attrs = append(attrs, telemetry.AttrAttempts.Int(d.Retries()+1))
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
