package middleware

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/oklog/ulid/v2"

	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/internal/crashpoint"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// maxReasonLength bounds the reason header; some brokers limit header sizes.
const maxReasonLength = 1024

// deadLetterRecordTimeout bounds the reads and writes of the router's records, which outlive
// the delivery's context.
const deadLetterRecordTimeout = 10 * time.Second

// ErrDeliveryLimit reports a message given up because it reached its handler's delivery limit
// (DeadLetter.MaxDeliveries) without succeeding. The dead letter's reason says after how many
// deliveries, and the last error.
var ErrDeliveryLimit = errors.New("delivery limit reached")

// ErrDeadLetterFailed reports a message that was to be dead-lettered but that the dead-letter
// broker refused under every form PublishDeadLetter tries: the broker is failing, not the
// message. The error is retryable, and an outage (sqldb.IsOutage: its Outage method reports
// true): the router gives the message back uncounted and pauses the handler until the
// dead-letter broker takes messages again.
var ErrDeadLetterFailed error = outageError("dead-letter publish failed")

// outageError is a sentinel error that sqldb.IsOutage reports.
type outageError string

func (e outageError) Error() string { return string(e) }

// Outage reports true: the error is a failure of the world, not of a message.
func (outageError) Outage() bool { return true }

// DefaultMaxDeliveries is the delivery limit of a DeadLetter whose MaxDeliveries is zero.
const DefaultMaxDeliveries = 10

// DeadLetter configures the dead-letter stage: it publishes a message that cannot succeed to
// the dead-letter topic, then reports it as handled. The zero value is the default
// configuration.
//
// A message cannot succeed when the stages inside return a permanent error: processor.Permanent,
// or an error that Classifier finds permanent (a malformed payload, a message without an id, a
// data error; DefaultClassifier has the table). The stages inside see the same classification
// (Delivery.Permanent): Retry does not retry such an error. With a delivery limit, a message
// also cannot succeed when it reaches the limit. The stage publishes the message, with its id,
// payload and headers, plus the headers messagedata.HeaderDeadLetterReason (the error text),
// HeaderDeadLetterHandler, HeaderDeadLetterAttempt, HeaderDeadLetterDeliveries,
// HeaderDeadLetterTopic and HeaderDeadLetterTime, and HeaderDeadLetterKey (DeadLetterKey), and
// returns an error wrapping processor.ErrDeadLettered: the router acks the message. Other
// outcomes pass through unchanged.
//
// A dead letter is published, then the message is acknowledged: a consumer that dies in
// between (or whose acknowledgement is lost) leaves the message to be delivered again, and its
// dead letter to be published again. Under the router, which records each dead letter durably,
// a redelivery after the record is acknowledged without a second publish; one before it (the
// consumer died between the publish and the record) publishes the dead letter again with the
// same id and the same HeaderDeadLetterKey, which a broker that deduplicates by that key drops:
// the embedded SQLite queue and the SQL queues within an hour of the first, NATS within its
// duplicate window. On the other brokers (RabbitMQ, Redis, Kafka) that second copy reaches the
// dead-letter topic, recognisable by its key.
//
// A dead letter is never refused for the message's own sake: when the publisher refuses it (an
// id the broker cannot carry, a payload too large), the stage publishes it again under an id
// derived from the original one, which goes in HeaderDeadLetterOriginalID, and if that is
// refused too, without its payload, saying so in HeaderDeadLetterPayloadDropped. When even that
// fails, the dead-letter broker itself is failing: the stage returns the failure, wrapping
// ErrDeadLetterFailed, which is not permanent, and the router nacks the message so that it is
// not lost and comes back later.
//
// The dead letter is published under a producer span "send <topic>", a child of the failed
// delivery's consumer span, whose trace context goes in its headers (W3C traceparent, written
// by the propagator of the Tracing stage outside, or the global one): its consumers continue
// the trace of the failed delivery. The published message carries the incoming message's
// context.
type DeadLetter struct {
	// MaxDeliveries is the delivery limit: a message whose MaxDeliveries-th delivery
	// (messagedata.MessageData.Delivery) fails, with an error that running again might cure or
	// with a panic, is dead-lettered with the reason "delivery limit reached after N deliveries:
	// <its error>" instead of being nacked; a message delivered more times than that (a
	// delivery ended without an outcome: the consumer died or its acknowledgement was lost) is
	// dead-lettered before it is processed. A message whose delivery count is unknown (0) is
	// never given up this way, nor, under the router, a delivery whose attempt the router could
	// not record (its database was unreachable): the broker's count alone also counts
	// deliveries that never began. Under the router, the count the limit applies to is that of
	// the deliveries whose processing began, where the router knows it: a delivery that waited
	// behind a message that killed its consumer, and never began, does not count. Defaults to
	// DefaultMaxDeliveries; negative turns the limit off.
	MaxDeliveries int

	// Classifier tells errors that running a message again cannot cure (dead-lettered on first
	// sight) from the others (retried, then redelivered). Defaults to DefaultClassifier.
	Classifier Classifier
}

// limit returns the delivery limit of d, 0 for none.
func (d DeadLetter) limit() int {
	switch {
	case d.MaxDeliveries < 0:
		return 0
	case d.MaxDeliveries == 0:
		return DefaultMaxDeliveries
	}
	return d.MaxDeliveries
}

// Middleware returns the dead-letter stage of d for handler, which publishes dead letters to
// topic on pub. It fails, naming the argument, when pub is nil or topic is empty.
func (d DeadLetter) Middleware(pub message.Publisher, topic, handler string) (Middleware, error) {
	switch {
	case pub == nil:
		return nil, errors.New("DeadLetter: the publisher is nil")
	case topic == "":
		return nil, errors.New("DeadLetter: the topic is empty")
	}
	limit, classify := d.limit(), d.Classifier
	if classify == nil {
		classify = DefaultClassifier
	}
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			var err error
			var rec *delivery.Records
			n := msg.Delivery
			st := delivery.From(ctx)
			if st != nil {
				st.Classify, rec = classify, st.Records
				switch {
				case st.Attempts > 0:
					n = st.Attempts // the deliveries that began: none given back unprocessed
				case st.AttemptUnrecorded:
					n = 0 // how many deliveries began is unknown: no limit
				case n > 0 && st.Uncounted > 0:
					n = max(n-st.Uncounted, 1) // given back during outages: not counted
				}
			}
			if rec == nil {
				rec = &delivery.Records{}
			}
			if limit > 0 && n > limit {
				if rec.Processed != nil {
					if done, perr := rec.Processed(ctx, msg); perr == nil && done {
						return fmt.Errorf("%w: over the delivery limit, and processed already", processor.ErrDuplicate)
					}
				}
				err = processor.Permanent(fmt.Errorf("%w after %d deliveries: the last one ended without an outcome (its consumer stopped, or its acknowledgement was lost)",
					ErrDeliveryLimit, n-1))
			} else {
				err = next.Process(ctx, msg)
				if err != nil && !processor.IsPermanent(err) && processor.OutcomeOf(err) == processor.Failed && classify(err) {
					err = processor.Permanent(err)
				}
				if limit > 0 && n >= limit && givesUp(ctx, err) {
					err = processor.Permanent(fmt.Errorf("%w after %d deliveries: %w", ErrDeliveryLimit, n, err))
				}
			}
			if err == nil && rec.MarkProcessed != nil && n > 1 {
				mctx, cancel := recordContext(ctx)
				_ = rec.MarkProcessed(mctx, msg)
				cancel()
			}
			if err == nil || !processor.IsPermanent(err) {
				return err
			}
			if st != nil {
				// The dead letter reports the attempt and the delivery count the router logs.
				m := *msg
				m.Attempt, m.Delivery = st.Attempt(), st.Delivery(msg.Delivery)
				msg = &m
			}
			// The record is read and written even when the delivery has ended meanwhile (its
			// lease or ack deadline passed while the dead letter was published): the message
			// comes back then, and only the record tells the redelivery that its dead letter is
			// out.
			rctx, cancel := recordContext(ctx)
			defer cancel()
			if rec.DeadLettered != nil && msg.Delivery != 1 { // a first delivery has no dead letter before it
				if done, rerr := rec.DeadLettered(rctx, msg); rerr == nil && done {
					return fmt.Errorf("%w to %s at an earlier delivery, whose acknowledgement was lost: %w", processor.ErrDeadLettered, topic, err)
				}
			}
			if pubErr := PublishDeadLetter(ctx, pub, topic, handler, msg, err); pubErr != nil {
				return fmt.Errorf("%w after %v: %w", ErrDeadLetterFailed, err, pubErr)
			}
			crashpoint.Reach(crashpoint.DeadLettered, msg.ID)
			if rec.MarkDeadLettered != nil {
				if rerr := rec.MarkDeadLettered(rctx, msg); rerr != nil {
					return fmt.Errorf("%w to %s (not recorded, so a redelivery would be dead-lettered again: %v): %w", processor.ErrDeadLettered, topic, rerr, err)
				}
			}
			return fmt.Errorf("%w to %s: %w", processor.ErrDeadLettered, topic, err)
		})
	}, nil
}

// recordContext returns the context of a record's read or write for a delivery with ctx: its
// values without its end, bounded by deadLetterRecordTimeout.
func recordContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), deadLetterRecordTimeout)
}

// givesUp reports whether err, the outcome of the last allowed delivery, is a failure that the
// delivery limit ends: an error or panic of the message's own, not the end of the delivery (a
// consumer shutting down, an ack deadline), nor a commit whose outcome is unknown, after which
// the message may well have been applied, nor an outage (sqldb.IsOutage), which is no
// message's fault.
func givesUp(ctx context.Context, err error) bool {
	switch processor.OutcomeOf(err) {
	case processor.Failed, processor.Panicked:
	default:
		return false
	}
	if processor.IsPermanent(err) || errors.Is(err, ErrCommitOutcomeUnknown) || sqldb.IsOutage(err) {
		return false
	}
	return ctx.Err() == nil
}

// PublishDeadLetter publishes msg to topic on pub with the dead-letter headers for reason. A
// message without an id gets a fresh one, so that it can be listed and replayed. When pub
// refuses the message, it tries again under an id derived from the original one (kept in
// messagedata.HeaderDeadLetterOriginalID), and then without the payload
// (messagedata.HeaderDeadLetterPayloadDropped says why); it returns an error only when every
// attempt failed, which means the dead-letter broker is failing, not the message.
func PublishDeadLetter(ctx context.Context, pub message.Publisher, topic, handler string, msg *messagedata.MessageData, reason error) (err error) {
	ctx, span := telemetry.Send(ctx, topic, telemetry.AttrHandler.String(handler))
	if span != nil {
		defer func() { telemetry.End(span, err) }()
	}
	out := deadLetter(ctx, handler, msg, reason)
	first := pub.Publish(topic, out)
	if first == nil {
		return nil
	}
	// The broker may refuse the id (too long, characters it cannot carry): a derived id, which
	// every broker accepts, keeps retried dead letters of one message under one id. It may
	// refuse the headers this function wrote (NATS refuses a line break in a header value,
	// which a reason made by errors.Join has): they are made header-safe.
	again := deadLetter(ctx, handler, msg, reason)
	for _, k := range []string{messagedata.HeaderDeadLetterReason, messagedata.HeaderDeadLetterHandler, messagedata.HeaderDeadLetterTopic} {
		again.Metadata[k] = headerSafe(again.Metadata[k])
	}
	again.Metadata[messagedata.HeaderDeadLetterOriginalID] = headerSafe(out.UUID)
	again.Metadata[messagedata.HeaderDeadLetterKey] = out.Metadata[messagedata.HeaderDeadLetterKey]
	again.UUID = derivedID(out.UUID)
	second := pub.Publish(topic, again)
	if second == nil {
		return nil
	}
	// The payload or a header may be what it refuses: keep the reason and the ids.
	bare := message.NewMessage(again.UUID, nil)
	for _, k := range []string{messagedata.HeaderDeadLetterReason, messagedata.HeaderDeadLetterHandler,
		messagedata.HeaderDeadLetterAttempt, messagedata.HeaderDeadLetterDeliveries, messagedata.HeaderDeadLetterTopic,
		messagedata.HeaderDeadLetterTime, messagedata.HeaderDeadLetterOriginalID, messagedata.HeaderDeadLetterKey, messagedata.HeaderKey,
		messagedata.HeaderSequence} {
		if v, ok := again.Metadata[k]; ok {
			bare.Metadata[k] = v
		}
	}
	bare.Metadata[messagedata.HeaderDeadLetterPayloadDropped] = headerSafe(fmt.Sprintf("%d bytes and %d headers dropped: the dead-letter broker refused the message: %v",
		len(msg.Payload), len(msg.Headers), second))
	bare.SetContext(out.Context())
	third := pub.Publish(topic, bare)
	if third == nil {
		return nil
	}
	return fmt.Errorf("publish to dead-letter topic %q: %w", topic, errors.Join(first, second, third))
}

// deadLetter returns the dead letter of msg: the message with the dead-letter headers.
func deadLetter(ctx context.Context, handler string, msg *messagedata.MessageData, reason error) *message.Message {
	out := converter.ToMessage(msg)
	if out.UUID == "" {
		out.UUID = watermill.NewULID()
	}
	out.Metadata[messagedata.HeaderDeadLetterReason] = truncate(reason.Error(), maxReasonLength)
	out.Metadata[messagedata.HeaderDeadLetterHandler] = handler
	out.Metadata[messagedata.HeaderDeadLetterAttempt] = strconv.Itoa(max(msg.Attempt, 1))
	if msg.Delivery > 0 {
		out.Metadata[messagedata.HeaderDeadLetterDeliveries] = strconv.Itoa(msg.Delivery)
	}
	out.Metadata[messagedata.HeaderDeadLetterTopic] = msg.Topic
	out.Metadata[messagedata.HeaderDeadLetterTime] = time.Now().UTC().Format(time.RFC3339Nano)
	out.Metadata[messagedata.HeaderDeadLetterKey] = DeadLetterKey(handler, out.UUID, msg.Header(messagedata.HeaderReplayCount))
	telemetry.Inject(ctx, out.Metadata)
	out.SetContext(ctx)
	return out
}

// DeadLetterKey returns the key of the dead letter that handler publishes for the message with
// id, replayed replayCount times (messagedata.HeaderReplayCount; empty if never): the value of
// messagedata.HeaderDeadLetterKey. It is the same at every publish of that dead letter, under
// whatever id the dead-letter broker accepts, and differs between handlers and between replays
// of the message: a 26-character string of Crockford base32, made from the SHA-256 of the
// three, which every broker carries in a header and NATS as a Nats-Msg-Id.
func DeadLetterKey(handler, id, replayCount string) string {
	return derivedID(handler + "\x00" + id + "\x00" + replayCount)
}

// derivedID returns an id for a dead letter whose own id the broker refused: a ULID-shaped
// string (26 characters of Crockford base32, accepted by every broker onceflow supports)
// made from the SHA-256 of id, so that every attempt for one message uses the same one.
func derivedID(id string) string {
	sum := sha256.Sum256([]byte(id))
	var u ulid.ULID
	copy(u[:], sum[:])
	return u.String()
}

// headerSafe returns s as a header value that every broker carries: valid UTF-8 without
// control characters (each becomes U+FFFD), at most maxReasonLength bytes, so that the header
// itself is not what the broker refuses.
func headerSafe(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return '\uFFFD'
		}
		return r
	}, s)
	return truncate(s, maxReasonLength)
}

// truncate cuts s to at most n bytes, at a rune boundary.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !isRuneStart(s[n]) {
		n--
	}
	return s[:n]
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }
