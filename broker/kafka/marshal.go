package kafka

import (
	"fmt"
	"sort"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/messagedata"
)

// UUIDHeader is the record header that carries a message's UUID, as watermill's other
// adapters (watermill-kafka among them) write it.
const UUIDHeader = "_watermill_message_uuid"

// Record converts msg to a Kafka record for topic: the payload as the value, the metadata as
// headers (in the order of their names) and the UUID in UUIDHeader. The key is msg's ordering
// key (the header messagedata.HeaderKey) when it has one, so that the records of one key go to
// one partition, in order; otherwise its UUID, which spreads the records over the partitions.
func Record(topic string, msg *message.Message) *kgo.Record {
	names := make([]string, 0, len(msg.Metadata))
	for k := range msg.Metadata {
		if k != UUIDHeader {
			names = append(names, k)
		}
	}
	sort.Strings(names)
	headers := make([]kgo.RecordHeader, 0, len(names)+1)
	headers = append(headers, kgo.RecordHeader{Key: UUIDHeader, Value: []byte(msg.UUID)})
	for _, k := range names {
		headers = append(headers, kgo.RecordHeader{Key: k, Value: []byte(msg.Metadata[k])})
	}
	key := msg.Metadata.Get(messagedata.HeaderKey)
	if key == "" {
		key = msg.UUID
	}
	return &kgo.Record{Topic: topic, Key: []byte(key), Value: msg.Payload, Headers: headers}
}

// Message converts a Kafka record to a watermill message, and never fails. The UUID is the
// header UUIDHeader. A record of another producer without it gets an empty UUID if it carries
// messagedata.HeaderID, for onceflow's converter to take, and otherwise RecordID, the same for
// every delivery. The other headers become the metadata; of two with one name, the last wins.
func Message(r *kgo.Record) *message.Message {
	id := ""
	md := make(message.Metadata, len(r.Headers))
	for _, h := range r.Headers {
		if h.Key == UUIDHeader {
			id = string(h.Value)
			continue
		}
		md[h.Key] = string(h.Value)
	}
	if _, ok := md[messagedata.HeaderID]; id == "" && !ok {
		id = RecordID(r)
	}
	m := message.NewMessage(id, r.Value)
	m.Metadata = md
	return m
}

// RecordID is the id of a record that has no UUIDHeader: "topic/partition/offset".
func RecordID(r *kgo.Record) string {
	return fmt.Sprintf("%s/%d/%d", r.Topic, r.Partition, r.Offset)
}
