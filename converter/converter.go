// Package converter turns watermill messages into MessageData and back, with an explicit
// message-id policy. It is the message converter of the classic interceptor design (docs/background.md).
//
// The id of an incoming message is, in order of preference:
//
//  1. the watermill message UUID (watermill producers always set it; watermill-amqp carries it
//     in the header _watermill_message_uuid);
//  2. the header named by Config.IDHeader (defaults to messagedata.HeaderID, "onceflow_id");
//  3. the AMQP message_id property, which onceflow's AMQP adapter copies into the header
//     messagedata.HeaderAMQPMessageID.
//
// A message for which all three are empty has no usable id: FromMessage returns an error
// wrapping messagedata.ErrNoMessageID that names what it looked at, and the router
// dead-letters the message with that reason. It is never processed under an empty key.
package converter

import (
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/messagedata"
)

// Config configures a Converter.
type Config struct {
	// IDHeader is the header read for the message id when the message has no watermill UUID.
	// Defaults to messagedata.HeaderID.
	IDHeader string
}

// Converter converts between watermill messages and MessageData. It is safe for concurrent
// use.
type Converter struct {
	idHeader string
}

// New returns a Converter for cfg.
func New(cfg Config) *Converter {
	if cfg.IDHeader == "" {
		cfg.IDHeader = messagedata.HeaderID
	}
	return &Converter{idHeader: cfg.IDHeader}
}

// FromMessage converts msg, consumed from topic. The returned MessageData shares msg's payload
// and metadata map; treat both as read-only.
//
// It returns an error, with a MessageData holding everything it could read, when the message
// has no usable id (wrapping messagedata.ErrNoMessageID) or when an onceflow header holds a
// malformed value.
func (c *Converter) FromMessage(topic string, msg *message.Message) (*messagedata.MessageData, error) {
	md := &messagedata.MessageData{
		ID:      msg.UUID,
		Topic:   topic,
		Headers: msg.Metadata,
		Payload: msg.Payload,
		Attempt: 1,
	}
	if md.ID == "" {
		md.ID = msg.Metadata.Get(c.idHeader)
	}
	if md.ID == "" {
		md.ID = msg.Metadata.Get(messagedata.HeaderAMQPMessageID)
	}
	md.Key = msg.Metadata.Get(messagedata.HeaderKey)

	var err error
	if v := msg.Metadata.Get(messagedata.HeaderTimestamp); v != "" {
		ts, perr := time.Parse(time.RFC3339Nano, v)
		if perr != nil {
			err = fmt.Errorf("header %s holds %q, not an RFC 3339 time", messagedata.HeaderTimestamp, v)
		}
		md.Timestamp = ts
	}
	if v := msg.Metadata.Get(messagedata.HeaderSequence); v != "" {
		seq, perr := strconv.ParseUint(v, 10, 64)
		if perr != nil || seq == 0 {
			err = fmt.Errorf("header %s holds %q, not a positive integer", messagedata.HeaderSequence, v)
		}
		md.Sequence = seq
	}
	if md.ID == "" {
		return md, fmt.Errorf("%w (watermill uuid, header %q and AMQP message_id are empty)", messagedata.ErrNoMessageID, c.idHeader)
	}
	return md, err
}

// ToMessage converts md into a new watermill message with md.ID as its UUID, md's headers, and
// the timestamp, key and sequence in their onceflow headers.
func ToMessage(md *messagedata.MessageData) *message.Message {
	msg := message.NewMessage(md.ID, md.Payload)
	msg.Metadata = make(message.Metadata, len(md.Headers)+3)
	for k, v := range md.Headers {
		msg.Metadata[k] = v
	}
	if !md.Timestamp.IsZero() {
		msg.Metadata[messagedata.HeaderTimestamp] = md.Timestamp.UTC().Format(time.RFC3339Nano)
	}
	if md.Key != "" {
		msg.Metadata[messagedata.HeaderKey] = md.Key
	}
	if md.Sequence != 0 {
		msg.Metadata[messagedata.HeaderSequence] = strconv.FormatUint(md.Sequence, 10)
	}
	return msg
}
