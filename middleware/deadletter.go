package middleware

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// maxReasonLength bounds the reason header; some brokers limit header sizes.
const maxReasonLength = 1024

// DeadLetter publishes a message whose processing failed permanently to topic on pub, then
// reports it as handled.
//
// A permanent error (processor.Permanent, a malformed payload, a message without an id) reaches
// DeadLetter from the chain inside. DeadLetter publishes the message, with its id, payload and
// headers, plus the headers messagedata.HeaderDeadLetterReason (the error text),
// HeaderDeadLetterHandler, HeaderDeadLetterAttempt, HeaderDeadLetterTopic and
// HeaderDeadLetterTime, and returns an error wrapping processor.ErrDeadLettered: the router acks
// the message. If the publish fails, DeadLetter returns that failure and the router nacks, so
// the message is not lost. Other outcomes pass through unchanged.
//
// The published message carries the incoming message's context, so a broker adapter can publish
// it in the same unit of work as the acknowledgement (the embedded SQLite queue does), and the
// trace context of ctx in its headers (W3C traceparent, written by the propagator of the Tracing
// middleware outside, or the global one): its consumers continue the trace of the failed
// delivery.
func DeadLetter(pub message.Publisher, topic, handler string) Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			if err == nil || !processor.IsPermanent(err) {
				return err
			}
			if pubErr := PublishDeadLetter(ctx, pub, topic, handler, msg, err); pubErr != nil {
				return fmt.Errorf("dead-letter after %v: %w", err, pubErr)
			}
			return fmt.Errorf("%w to %s: %w", processor.ErrDeadLettered, topic, err)
		})
	}
}

// PublishDeadLetter publishes msg to topic on pub with the dead-letter headers for reason. A
// message without an id gets a fresh one, so that it can be listed and replayed.
func PublishDeadLetter(ctx context.Context, pub message.Publisher, topic, handler string, msg *messagedata.MessageData, reason error) error {
	out := converter.ToMessage(msg)
	if out.UUID == "" {
		out.UUID = watermill.NewULID()
	}
	text := reason.Error()
	if len(text) > maxReasonLength {
		text = text[:maxReasonLength]
	}
	out.Metadata[messagedata.HeaderDeadLetterReason] = text
	out.Metadata[messagedata.HeaderDeadLetterHandler] = handler
	out.Metadata[messagedata.HeaderDeadLetterAttempt] = strconv.Itoa(max(msg.Attempt, 1))
	out.Metadata[messagedata.HeaderDeadLetterTopic] = msg.Topic
	out.Metadata[messagedata.HeaderDeadLetterTime] = time.Now().UTC().Format(time.RFC3339Nano)
	telemetry.Inject(ctx, out.Metadata)
	out.SetContext(ctx)
	if err := pub.Publish(topic, out); err != nil {
		return fmt.Errorf("publish to dead-letter topic %q: %w", topic, err)
	}
	return nil
}
