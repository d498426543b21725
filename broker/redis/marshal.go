package redis

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/vmihailenco/msgpack"

	"github.com/onceflow/onceflow/broker"
)

// Fields of a stream entry that watermill-redisstream writes, besides the UUID
// (redisstream.UUIDHeaderKey).
const (
	fieldMetadata = "metadata"
	fieldPayload  = "payload"
)

// Marshaller converts between watermill messages and stream entries in
// watermill-redisstream's format: the UUID in the field "_watermill_message_uuid", the
// metadata msgpack-encoded in "metadata", the payload in "payload". Its Unmarshal never
// fails, so that an entry of another producer is delivered (and can be dead-lettered).
type Marshaller struct{}

var _ redisstream.MarshallerUnmarshaller = Marshaller{}

// Marshal converts msg to the fields of a stream entry, as watermill-redisstream's default
// marshaller does.
func (Marshaller) Marshal(topic string, msg *message.Message) (map[string]any, error) {
	return redisstream.DefaultMarshallerUnmarshaller{}.Marshal(topic, msg)
}

// Unmarshal converts the fields of a stream entry to a watermill message. An entry without a
// UUID field gets an empty UUID; fields other than the UUID, metadata and payload (written by
// another producer) become metadata; metadata that does not decode is kept in the header
// broker.HeaderRedisMetadata. It never returns an error.
func (Marshaller) Unmarshal(values map[string]any) (*message.Message, error) {
	msg := message.NewMessage("", nil)
	md := msg.Metadata
	var id, payload string
	for k, v := range values {
		s, ok := v.(string) // as go-redis reads every field
		if !ok {
			s = fmt.Sprint(v)
		}
		switch k {
		case redisstream.UUIDHeaderKey:
			id = s
		case fieldPayload:
			payload = s
		case fieldMetadata:
			if s == "" {
				continue
			}
			decoded := message.Metadata{}
			if err := msgpack.Unmarshal([]byte(s), &decoded); err != nil {
				md[broker.HeaderRedisMetadata] = s
				continue
			}
			for mk, mv := range decoded {
				md[mk] = mv
			}
		default:
			if _, ok := md[k]; !ok {
				md[k] = s
			}
		}
	}
	msg.UUID, msg.Payload = id, []byte(payload)
	return msg, nil
}
