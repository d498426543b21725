package outbox

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// envelope is the payload of an outbox row: one outgoing message and its destination topic,
// as JSON in the format of watermill's forwarder (components/forwarder), which earlier
// versions of the outbox wrote through it. The row's own uuid is the envelope's, fresh for
// every row; the message's UUID is inside.
type envelope struct {
	DestinationTopic string            `json:"destination_topic"`
	UUID             string            `json:"uuid"`
	Payload          []byte            `json:"payload"`
	Metadata         map[string]string `json:"metadata"`
}

// wrap returns the row of msg for topic: an envelope under a new UUID.
func wrap(topic string, msg *message.Message) (*message.Message, error) {
	body, err := json.Marshal(envelope{DestinationTopic: topic, UUID: msg.UUID, Payload: msg.Payload, Metadata: msg.Metadata})
	if err != nil {
		return nil, fmt.Errorf("message %s: %w", msg.UUID, err)
	}
	return message.NewMessage(watermill.NewUUID(), body), nil
}

// unwrap returns the destination topic and the message of a row, with the row's context.
func unwrap(row *message.Message) (string, *message.Message, error) {
	var env envelope
	if err := json.Unmarshal(row.Payload, &env); err != nil {
		return "", nil, fmt.Errorf("the row is not a message envelope: %w", err)
	}
	if env.DestinationTopic == "" {
		return "", nil, errors.New("the row's envelope names no destination topic")
	}
	msg := message.NewMessage(env.UUID, env.Payload)
	if env.Metadata != nil {
		msg.Metadata = env.Metadata
	}
	msg.SetContext(row.Context())
	return env.DestinationTopic, msg, nil
}
