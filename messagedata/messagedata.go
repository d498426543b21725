// Package messagedata defines MessageData, the broker-neutral value a Processor receives.
//
// MessageData is the neutral message value of the classic interceptor design
// (docs/background.md): everything a processor needs from the
// incoming message, and nothing that ties it to a particular broker. It imports no broker
// package; converters in package converter fill it from watermill messages.
package messagedata

import (
	"errors"
	"time"
)

// Header names that onceflow reads from and writes to message metadata. Brokers carry them
// as ordinary string headers.
const (
	// HeaderID carries the message id when the broker has no native id field. The converter
	// reads it as one of the fallbacks of its id policy.
	HeaderID = "onceflow_id"
	// HeaderTimestamp carries the time the message was produced. onceflow writes it in RFC
	// 3339 format with nanoseconds, and reads the forms other producers write too
	// (ParseTimestamp).
	HeaderTimestamp = "onceflow_timestamp"
	// HeaderKey carries the ordering key.
	HeaderKey = "onceflow_key"
	// HeaderSequence carries the per-key sequence number, a positive decimal integer.
	HeaderSequence = "onceflow_seq"
	// HeaderAMQPMessageID carries the AMQP message_id property of a delivery, so that messages
	// from producers that set only the property still have an id.
	HeaderAMQPMessageID = "amqp_message_id"

	// HeaderDeadLetterReason says why a message was dead-lettered.
	HeaderDeadLetterReason = "onceflow_dlq_reason"
	// HeaderDeadLetterHandler names the handler that dead-lettered the message.
	HeaderDeadLetterHandler = "onceflow_dlq_handler"
	// HeaderDeadLetterAttempt is the processing attempt at which the message was dead-lettered.
	HeaderDeadLetterAttempt = "onceflow_dlq_attempt"
	// HeaderDeadLetterTopic is the topic the message was consumed from; replay sends it back there.
	HeaderDeadLetterTopic = "onceflow_dlq_topic"
	// HeaderDeadLetterTime is when the message was dead-lettered, in RFC 3339 format.
	HeaderDeadLetterTime = "onceflow_dlq_time"
	// HeaderDeadLetterDeliveries is how many times the message had been delivered when it was
	// dead-lettered, when that is known.
	HeaderDeadLetterDeliveries = "onceflow_dlq_deliveries"
	// HeaderDeadLetterOriginalID carries the id of a dead-lettered message whose own id the
	// dead-letter broker refused (too long for it, say): the dead letter is published under an
	// id derived from the original one, which this header keeps.
	HeaderDeadLetterOriginalID = "onceflow_dlq_original_id"
	// HeaderDeadLetterPayloadDropped is set on a dead letter whose payload the dead-letter
	// broker refused even under a new id (too large for it, say): the dead letter carries the
	// headers and the reason without the payload, and this header says how many bytes were
	// dropped and why.
	HeaderDeadLetterPayloadDropped = "onceflow_dlq_payload_dropped"
	// HeaderDeadLetterKey identifies one dead letter: it is made from the handler that
	// dead-lettered the message, the message's id and its replay count, so every publish of
	// the dead letter of one message by one handler carries the same key, also one published
	// again by the next consumer after the first died before it could record the dead letter.
	// A broker that can drop a second publish of a key does: the embedded SQLite queue and the
	// PostgreSQL and MySQL queues within an hour, NATS JetStream within its duplicate window
	// (see docs/operations.md, Dead letters).
	HeaderDeadLetterKey = "onceflow_dlq_key"

	// HeaderReplayCount is set on a dead letter that `onceflow dlq replay` puts back on its
	// topic: how many times the message has been replayed, a positive decimal integer. The
	// replay removes the dead-letter headers above; a message that is dead-lettered again
	// carries its replay count into the new dead letter.
	HeaderReplayCount = "onceflow_replay_count"
	// HeaderReplayTime is when the message was last replayed, in RFC 3339 format.
	HeaderReplayTime = "onceflow_replay_time"
)

// DeadLetterHeaders are the headers that dead-lettering adds to a message, and that a replay
// of the dead letter removes.
var DeadLetterHeaders = []string{
	HeaderDeadLetterReason,
	HeaderDeadLetterHandler,
	HeaderDeadLetterAttempt,
	HeaderDeadLetterDeliveries,
	HeaderDeadLetterTopic,
	HeaderDeadLetterTime,
	HeaderDeadLetterOriginalID,
	HeaderDeadLetterPayloadDropped,
	HeaderDeadLetterKey,
}

// MessageData is one incoming message, independent of the broker it came from.
//
// A processor must treat MessageData as read-only: the same value may be shared by the
// middlewares around it.
type MessageData struct {
	// ID identifies the message for duplicate detection. It is stable across redeliveries of
	// the same message. It is empty when the message carried no usable id; the Deduplicate
	// middleware refuses such a message instead of processing it under an empty key.
	ID string

	// Timestamp is when the producer created the message, when the message says so; the zero
	// time otherwise.
	Timestamp time.Time

	// Topic is the topic (queue, subject, stream) the message was consumed from.
	Topic string

	// Key is the ordering key: messages with the same key are applied in Sequence order by the
	// ExactlyOnceInOrder quality of service. Empty when the producer set none.
	Key string

	// Sequence is the position of the message among the messages of its Key, starting at 1.
	// Zero when the producer assigned none.
	Sequence uint64

	// Headers are the message's metadata, including the onceflow headers above.
	Headers map[string]string

	// Payload is the message body.
	Payload []byte

	// Attempt counts processing attempts of this delivery within this process, starting at 1.
	// The Retry middleware increments it for each new attempt.
	Attempt int
	// Delivery counts the deliveries of the message, this one included: 1 the first time the
	// broker hands it out, 2 when it comes again after a nack, a lost acknowledgement or a
	// consumer that died. The router takes it from the broker where the broker counts, and
	// otherwise keeps the count durably in the handler's database; the DeadLetter middleware
	// gives a message up at the handler's delivery limit. Zero when nobody counted.
	Delivery int
}

// Header returns the value of header name, or "" when it is absent.
func (m *MessageData) Header(name string) string {
	if m.Headers == nil {
		return ""
	}
	return m.Headers[name]
}

// ErrNoMessageID reports a message that carries no usable id. Such a message cannot be
// deduplicated, so the exactly-once qualities of service dead-letter it instead of processing
// it under an empty key.
var ErrNoMessageID = errors.New("message has no id")
