package amqp

import (
	"encoding/json"
	"fmt"
	"math/big"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

// HeaderDeliveryCount is the header in which a quorum queue tells how many times it delivered
// a message before without an ack; RabbitMQ sets it, publishers do not.
const HeaderDeliveryCount = "x-delivery-count"

// Marshaler converts between watermill messages and AMQP messages, tolerantly. It implements
// watermill-amqp's Marshaler.
//
// Marshal stores the metadata as string headers, the message UUID in the header
// "_watermill_message_uuid" and in the AMQP message_id property, the onceflow_timestamp header
// (when it parses as RFC 3339) in the timestamp property, and makes the message persistent. It
// leaves out the headers of a delivery (amqp_message_id, amqp_redelivered, x-delivery-count),
// so that a message published again from a delivered one carries no stale delivery count.
//
// Unmarshal never fails, so that no delivery is nacked forever for a header that is not a
// string (RabbitMQ's x-death, another producer's numbers), as with watermill-amqp's default
// marshaler: numbers, booleans and decimals become their usual text, timestamps RFC 3339 with
// nanoseconds, byte arrays text, tables and arrays JSON. The UUID comes from the header
// "_watermill_message_uuid"; the message_id property goes to the header amqp_message_id
// (messagedata.HeaderAMQPMessageID), the timestamp property to onceflow_timestamp unless that
// header is set, and the redelivered flag to amqp_redelivered.
type Marshaler struct{}

// Marshal converts msg to an AMQP publishing. It fails only on a message id longer than the
// 255 bytes of the message_id property.
func (Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	headers := make(amqp.Table, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		switch k {
		case messagedata.HeaderAMQPMessageID, broker.HeaderAMQPRedelivered, HeaderDeliveryCount:
			// Properties of a delivery, not headers of the message.
			continue
		}
		headers[k] = v
	}
	id := msg.UUID
	if id == "" {
		id = msg.Metadata.Get(messagedata.HeaderAMQPMessageID)
	}
	if msg.UUID != "" {
		headers[wamqp.DefaultMessageUUIDHeaderKey] = msg.UUID
	}
	if len(id) > 255 {
		return amqp.Publishing{}, fmt.Errorf("message id %q is %d bytes, the AMQP message_id property allows 255", id, len(id))
	}
	p := amqp.Publishing{
		Headers:      headers,
		Body:         msg.Payload,
		DeliveryMode: amqp.Persistent,
		MessageId:    id,
	}
	if ts, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(messagedata.HeaderTimestamp)); err == nil {
		p.Timestamp = ts
	}
	return p, nil
}

// Unmarshal converts an AMQP delivery to a watermill message. It never returns an error.
func (Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	var id string
	if v, ok := d.Headers[wamqp.DefaultMessageUUIDHeaderKey]; ok {
		id = headerString(v)
	}
	msg := message.NewMessage(id, d.Body)
	// The message's own empty map takes a few headers; a map made for more saves growing it.
	md := msg.Metadata
	if n := len(d.Headers) + 3; n > smallMetadata {
		md = make(message.Metadata, n)
		msg.Metadata = md
	}
	for k, v := range d.Headers {
		if k != wamqp.DefaultMessageUUIDHeaderKey {
			md[k] = headerString(v)
		}
	}
	if d.MessageId != "" {
		md[messagedata.HeaderAMQPMessageID] = d.MessageId
	}
	if _, ok := md[messagedata.HeaderTimestamp]; !ok && !d.Timestamp.IsZero() {
		md[messagedata.HeaderTimestamp] = d.Timestamp.UTC().Format(time.RFC3339Nano)
	}
	if d.Redelivered {
		md[broker.HeaderAMQPRedelivered] = "true"
	}
	return msg, nil
}

// smallMetadata is how many entries an empty map takes before it grows (one group of Go's maps).
const smallMetadata = 8

// headerString renders an AMQP field value as a string, as Marshaler says (fmt prints a float
// in its shortest form).
func headerString(v any) string {
	if s, ok := v.(string); ok {
		return s // most headers: fmt would copy it
	}
	switch x := jsonValue(v).(type) {
	case nil:
		return ""
	case map[string]any, []any:
		b, err := json.Marshal(x)
		if err != nil {
			return fmt.Sprint(v)
		}
		return string(b)
	default:
		return fmt.Sprint(x)
	}
}

// jsonValue prepares an AMQP field value for JSON, tables and arrays recursively.
func jsonValue(v any) any {
	switch v := v.(type) {
	case amqp.Table:
		out := make(map[string]any, len(v))
		for k, x := range v {
			out[k] = jsonValue(x)
		}
		return out
	case map[string]any:
		return jsonValue(amqp.Table(v))
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = jsonValue(x)
		}
		return out
	case []byte:
		return string(v)
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case amqp.Decimal:
		return json.Number(decimalString(v))
	}
	return v
}

// decimalString renders an AMQP decimal (Value × 10^-Scale) exactly.
func decimalString(d amqp.Decimal) string {
	r := new(big.Rat).SetFrac(big.NewInt(int64(d.Value)), new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(d.Scale)), nil))
	return r.FloatString(int(d.Scale))
}
