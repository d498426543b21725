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
//
// A producer that sets no id, or one that is not stable (a new UUID each time it sends the
// same business event again), may still carry a business key in its payload or headers:
// Config.ID takes the id from there instead (JSONField, Header), and the message is processed
// exactly once by that key. A handler can also be given a MessageConverter of its own.
//
// The timestamp header (messagedata.HeaderTimestamp) is read as messagedata.ParseTimestamp
// reads it: RFC 3339, ISO 8601 without a zone (UTC), or epoch seconds or milliseconds. A value
// that is none of these is not the message's fault when its id and payload are fine: the
// message is converted as if it had no timestamp, and the Converter logs that once.
package converter

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/messagedata"
)

// MessageConverter turns an incoming watermill message into the MessageData its processor
// sees. *Converter is the default one; a handler may take another (Handler.Converter). An
// error that wraps messagedata.ErrNoMessageID, or any other error, makes the router
// dead-letter the message with the error as its reason, unprocessed; the MessageData returned
// with it, if any, carries what could be read. It must be safe for concurrent use.
type MessageConverter interface {
	FromMessage(topic string, msg *message.Message) (*messagedata.MessageData, error)
}

var _ MessageConverter = (*Converter)(nil)

// Config configures a Converter.
type Config struct {
	// IDHeader is the header read for the message id when the message has no watermill UUID.
	// Defaults to messagedata.HeaderID.
	IDHeader string

	// ID, when set, takes the message id from the message in place of the policy of the
	// package doc: from a business key in its payload (JSONField) or a header (Header), for
	// producers whose messages carry no stable id. An empty id it returns is an error
	// wrapping messagedata.ErrNoMessageID; any error it returns dead-letters the message.
	ID func(msg *message.Message) (string, error)

	// System is the messaging system the messages come from, as broker.Broker.MessagingSystem
	// names it ("rabbitmq", "nats", "kafka", ...): the error of a message without an id names
	// the id fields of that broker. The router gives a handler's default Converter its
	// subscriber's. Empty names every field the Converter reads.
	System string

	// Logger receives one warning, the first time a message's timestamp header cannot be read
	// (the router gives a handler's default Converter the handler's logger). Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// Converter converts between watermill messages and MessageData. It is safe for concurrent
// use.
type Converter struct {
	idHeader string
	noID     string // what a message without an id lacks, for its error
	id       func(msg *message.Message) (string, error)
	logger   *slog.Logger
	badTime  sync.Once // the warning of an unreadable timestamp
}

// New returns a Converter for cfg.
func New(cfg Config) *Converter {
	if cfg.IDHeader == "" {
		cfg.IDHeader = messagedata.HeaderID
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Converter{idHeader: cfg.IDHeader, noID: idFields(cfg.System, cfg.IDHeader), id: cfg.ID, logger: cfg.Logger}
}

// idFields says where a message from system was looked at for its id, for the error of a
// message that has none: the fields of that broker's wire format, in the order they are read.
func idFields(system, idHeader string) string {
	switch system {
	case "rabbitmq":
		return fmt.Sprintf("header _watermill_message_uuid, header %q and AMQP message_id are empty", idHeader)
	case "nats":
		return fmt.Sprintf("header _watermill_message_uuid, header Nats-Msg-Id and header %q are empty", idHeader)
	case "kafka":
		return fmt.Sprintf("record header _watermill_message_uuid and record header %q are empty", idHeader)
	case "redis":
		return fmt.Sprintf("stream field _watermill_message_uuid and header %q are empty", idHeader)
	case "postgresql", "mysql", "sqlite":
		return fmt.Sprintf("column uuid and header %q are empty", idHeader)
	case "mem":
		return fmt.Sprintf("watermill uuid and header %q are empty", idHeader)
	}
	return fmt.Sprintf("watermill uuid, header %q and AMQP message_id are empty", idHeader)
}

// JSONField returns a Config.ID that takes the id from the payload, a JSON object, at path: a
// field name, or names joined by dots for nested objects ("order.id"). A string is the id as
// it is; a number is its JSON text. A payload that is not JSON, or a path that leads to
// nothing, to null or to an object or array, is an error naming the path.
func JSONField(path string) func(msg *message.Message) (string, error) {
	names := strings.Split(path, ".")
	return func(msg *message.Message) (string, error) {
		var v any
		dec := json.NewDecoder(bytes.NewReader(msg.Payload))
		dec.UseNumber()
		if err := dec.Decode(&v); err != nil {
			return "", fmt.Errorf("id field %q: payload is not JSON: %w", path, err)
		}
		for _, name := range names {
			obj, ok := v.(map[string]any)
			if !ok {
				return "", fmt.Errorf("id field %q: no object holds %q", path, name)
			}
			if v, ok = obj[name]; !ok {
				return "", fmt.Errorf("id field %q: %q is missing", path, name)
			}
		}
		switch id := v.(type) {
		case string:
			return id, nil
		case json.Number:
			return id.String(), nil
		default:
			return "", fmt.Errorf("id field %q holds %T, not a string or a number", path, v)
		}
	}
}

// Header returns a Config.ID that takes the id from the header name.
func Header(name string) func(msg *message.Message) (string, error) {
	return func(msg *message.Message) (string, error) { return msg.Metadata.Get(name), nil }
}

// FromMessage converts msg, consumed from topic. The returned MessageData shares msg's payload
// and metadata map; treat both as read-only.
//
// It returns an error, with a MessageData holding everything it could read, when the message
// has no usable id (wrapping messagedata.ErrNoMessageID) or when its sequence header holds a
// malformed value. A timestamp header it cannot read leaves the Timestamp zero, as if the
// message had none, for every copy of the message alike: the first such message of the
// Converter is logged as a warning, the later ones are not.
func (c *Converter) FromMessage(topic string, msg *message.Message) (*messagedata.MessageData, error) {
	md := &messagedata.MessageData{
		ID:      msg.UUID,
		Topic:   topic,
		Headers: msg.Metadata,
		Payload: msg.Payload,
		Attempt: 1,
	}
	var idErr error
	switch {
	case c.id != nil:
		md.ID, idErr = c.id(msg)
		if idErr == nil && md.ID == "" {
			idErr = fmt.Errorf("%w (the handler's id function found none)", messagedata.ErrNoMessageID)
		}
	default:
		if md.ID == "" {
			md.ID = msg.Metadata.Get(c.idHeader)
		}
		if md.ID == "" {
			md.ID = msg.Metadata.Get(messagedata.HeaderAMQPMessageID)
		}
		if md.ID == "" {
			idErr = fmt.Errorf("%w (%s)", messagedata.ErrNoMessageID, c.noID)
		}
	}
	md.Key = msg.Metadata.Get(messagedata.HeaderKey)

	var err error
	if v := msg.Metadata.Get(messagedata.HeaderTimestamp); v != "" {
		ts, perr := messagedata.ParseTimestamp(v)
		if perr != nil {
			c.badTime.Do(func() {
				cmp.Or(c.logger, slog.Default()).Warn("A message's timestamp cannot be read: such messages are processed as if they had none (logged once)",
					"topic", topic, "message_id", md.ID, "error", perr)
			})
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
	if idErr != nil {
		return md, idErr
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
