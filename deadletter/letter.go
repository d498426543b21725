package deadletter

import (
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
)

// Letter is one dead letter: the message the router gave up, and what the dead-letter headers
// say about it.
type Letter struct {
	// ID is the dead letter's id: the message's own, or, when the dead-letter broker could not
	// carry that, one derived from it (OriginalID then holds the message's).
	ID string
	// OriginalID is the id of the dead-lettered message when the dead letter could not carry
	// it (messagedata.HeaderDeadLetterOriginalID); empty otherwise.
	OriginalID string
	// Topic is the topic the message was consumed from, where Replay puts it back.
	Topic string
	// Handler names the handler that gave the message up.
	Handler string
	// Reason is the error that made the handler give it up.
	Reason string
	// Time is when it was dead-lettered; zero when the header is absent or not RFC 3339.
	Time time.Time
	// Attempt is the processing attempt at which it was given up.
	Attempt int
	// Deliveries is how many times it had been delivered then; 0 when unknown.
	Deliveries int
	// Replays is how many times it had been replayed before (messagedata.HeaderReplayCount).
	Replays int
	// Key identifies the dead letter across the publishes of it (messagedata.HeaderDeadLetterKey).
	Key string
	// PayloadDropped says why the dead letter carries no payload: the dead-letter broker
	// refused the message with it (messagedata.HeaderDeadLetterPayloadDropped). Such a dead
	// letter cannot be replayed.
	PayloadDropped string
	// Headers are the message's own headers: without the dead-letter headers above, and
	// without the properties of the delivery the dead letter was read with (an AMQP
	// redelivered flag or message_id property).
	Headers map[string]string
	// Payload is the message's payload; nil in the reports of Replay and Delete.
	Payload []byte
	// PayloadSize is the length of the payload, also where Payload is left out.
	PayloadSize int
}

// MessageID returns the id of the dead-lettered message: OriginalID when the dead letter could
// not carry it, ID otherwise. A replay publishes the message under it.
func (l Letter) MessageID() string {
	if l.OriginalID != "" {
		return l.OriginalID
	}
	return l.ID
}

// DeliveryLimit reports whether the handler gave the message up because it reached its
// delivery limit (middleware.ErrDeliveryLimit), rather than for an error of its own.
func (l Letter) DeliveryLimit() bool {
	return strings.Contains(l.Reason, middleware.ErrDeliveryLimit.Error())
}

// deliveryHeaders are properties of the delivery a dead letter was read with, not headers of
// the message: reading without consuming sets RabbitMQ's redelivered flag.
var deliveryHeaders = []string{broker.HeaderAMQPRedelivered, messagedata.HeaderAMQPMessageID}

// letterOf reads the dead letter m.
func letterOf(m *message.Message) Letter {
	md := m.Metadata
	l := Letter{
		ID:             m.UUID,
		OriginalID:     md.Get(messagedata.HeaderDeadLetterOriginalID),
		Topic:          md.Get(messagedata.HeaderDeadLetterTopic),
		Handler:        md.Get(messagedata.HeaderDeadLetterHandler),
		Reason:         md.Get(messagedata.HeaderDeadLetterReason),
		Key:            md.Get(messagedata.HeaderDeadLetterKey),
		PayloadDropped: md.Get(messagedata.HeaderDeadLetterPayloadDropped),
		Headers:        make(map[string]string, len(md)),
		Payload:        m.Payload,
		PayloadSize:    len(m.Payload),
	}
	l.Time, _ = time.Parse(time.RFC3339Nano, md.Get(messagedata.HeaderDeadLetterTime))
	l.Attempt, _ = strconv.Atoi(md.Get(messagedata.HeaderDeadLetterAttempt))
	l.Deliveries, _ = strconv.Atoi(md.Get(messagedata.HeaderDeadLetterDeliveries))
	l.Replays, _ = strconv.Atoi(md.Get(messagedata.HeaderReplayCount))
	for k, v := range md {
		if !isDeadLetterHeader(k) && !isDeliveryHeader(k) {
			l.Headers[k] = v
		}
	}
	return l
}

func isDeadLetterHeader(k string) bool {
	for _, h := range messagedata.DeadLetterHeaders {
		if k == h {
			return true
		}
	}
	return false
}

func isDeliveryHeader(k string) bool {
	for _, h := range deliveryHeaders {
		if k == h {
			return true
		}
	}
	return false
}

// withoutPayload returns l without its payload, for a report.
func (l Letter) withoutPayload() Letter {
	l.Payload = nil
	return l
}

// replayMessage returns the message that replays dead letter m: its original id, payload and
// headers, without the dead-letter headers and the properties of the delivery it was read
// with, with the replay count raised by one and the replay time now.
func replayMessage(m *message.Message, now time.Time) *message.Message {
	l := letterOf(m)
	out := message.NewMessage(l.MessageID(), m.Payload)
	for k, v := range l.Headers {
		out.Metadata[k] = v
	}
	out.Metadata[messagedata.HeaderReplayCount] = strconv.Itoa(l.Replays + 1)
	out.Metadata[messagedata.HeaderReplayTime] = now.UTC().Format(time.RFC3339Nano)
	return out
}
