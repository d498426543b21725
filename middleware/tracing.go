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

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// Attribute keys that onceflow adds to the messaging semantic conventions.
const (
	// AttrHandler is the handler name.
	AttrHandler = attribute.Key("onceflow.handler")
	// AttrOutcome is the processor.Outcome of the delivery.
	AttrOutcome = attribute.Key("onceflow.outcome")
	// AttrAttempts is the number of processing attempts the delivery took.
	AttrAttempts = attribute.Key("onceflow.attempts")
)

// TracingOption configures Tracing.
type TracingOption interface{ applyTracing(*tracingConfig) }

type tracingConfig struct {
	provider   trace.TracerProvider
	propagator propagation.TextMapPropagator
	system     string
}

type tracingOptionFunc func(*tracingConfig)

func (f tracingOptionFunc) applyTracing(c *tracingConfig) { f(c) }

// WithTracerProvider sets the TracerProvider. Defaults to the global provider (otel.GetTracerProvider).
func WithTracerProvider(tp trace.TracerProvider) TracingOption {
	return tracingOptionFunc(func(c *tracingConfig) { c.provider = tp })
}

// WithPropagator sets the propagator that reads the parent context from message headers.
// Defaults to the global propagator (otel.GetTextMapPropagator).
func WithPropagator(p propagation.TextMapPropagator) TracingOption {
	return tracingOptionFunc(func(c *tracingConfig) { c.propagator = p })
}

// WithMessagingSystem sets the messaging.system attribute, such as "rabbitmq", "nats", "redis"
// or "sqlite". Defaults to "onceflow".
func WithMessagingSystem(system string) TracingOption {
	return tracingOptionFunc(func(c *tracingConfig) { c.system = system })
}

// Tracing starts one consumer span per message, following the OpenTelemetry messaging
// semantic conventions: named "process <topic>", kind consumer, with messaging.system,
// messaging.destination.name, messaging.message.id, messaging.operation.type and .name
// ("process"), and messaging.consumer.group.name (the handler), plus onceflow.handler,
// onceflow.outcome and onceflow.attempts. The parent is the context that the producer injected
// into the message headers (W3C traceparent), so a trace continues across brokers and across
// the outbox relay. An outcome other than processed or duplicate records the error and sets an
// error status. The middlewares inside add child spans for the dedup check, the processor and
// the commit. Under the router, the consumer span ends after the acknowledgement, which it
// records as a child span.
func Tracing(handler string, opts ...TracingOption) Middleware {
	cfg := tracingConfig{system: "onceflow"}
	for _, o := range opts {
		o.applyTracing(&cfg)
	}
	return func(next processor.Processor) processor.Processor {
		provider := cfg.provider
		if provider == nil {
			provider = otel.GetTracerProvider()
		}
		tracer := provider.Tracer(telemetry.ScopeName)
		startOpts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
		var names spanNames
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			prop := cfg.propagator
			if prop == nil {
				prop = otel.GetTextMapPropagator()
			}
			ctx = prop.Extract(ctx, telemetry.HeaderCarrier(msg.Headers))
			ctx, span := tracer.Start(ctx, names.get(msg.Topic), startOpts...)
			recording := span.IsRecording()
			if recording {
				span.SetAttributes(
					semconv.MessagingSystemKey.String(cfg.system),
					semconv.MessagingDestinationName(msg.Topic),
					semconv.MessagingMessageID(msg.ID),
					semconv.MessagingOperationTypeProcess,
					semconv.MessagingOperationName("process"),
					semconv.MessagingConsumerGroupName(handler),
					semconv.MessagingMessageBodySize(len(msg.Payload)),
					AttrHandler.String(handler),
				)
			}
			err := next.Process(ctx, msg)
			st := delivery.From(ctx)
			if recording {
				outcome := processor.OutcomeOf(err)
				span.SetAttributes(AttrOutcome.String(string(outcome)))
				if st != nil {
					span.SetAttributes(AttrAttempts.Int(st.Retries + 1))
				}
				if outcome == processor.Failed || outcome == processor.Panicked || outcome == processor.DeadLettered {
					span.RecordError(err)
					span.SetStatus(codes.Error, err.Error())
				}
			}
			if st != nil && st.Span == nil {
				// The router acknowledges after the chain returns: it records the ack as a child
				// span and ends this one then.
				st.Span = span
				return err
			}
			span.End()
			return err
		})
	}
}

// spanNames caches the span name "process <topic>" for the topic a handler consumes, so that
// naming a span does not allocate.
type spanNames struct {
	cached atomic.Pointer[spanName]
}

type spanName struct{ topic, name string }

func (c *spanNames) get(topic string) string {
	if n := c.cached.Load(); n != nil && n.topic == topic {
		return n.name
	}
	n := &spanName{topic: topic, name: "process " + topic}
	c.cached.Store(n)
	return n.name
}
