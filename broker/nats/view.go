package nats

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/onceflow/onceflow/broker"
)

// view reads the stream that stores a topic by sequence, past the ack floor of the group's
// durable consumer, through JetStream's message-get API, without touching the consumer.
// Remove deletes a message from the stream (DeleteMsg). A message that the group acknowledged
// above the ack floor (out of order) is listed until the floor passes it: JetStream does not
// say which messages above the floor are acknowledged.
type view struct {
	js     nats.JetStreamContext
	msgs   jetstream.Stream
	topic  string
	stream string
	start  uint64 // the first sequence that may wait for the group
}

// newView opens views of the streams of topics. A topic that no stream captures is an error
// wrapping broker.ErrNotFound; a group whose durable consumer does not exist reads the whole
// stream, as its consumer will when it is created.
func newView(js nats.JetStreamContext, njs jetstream.JetStream, group string) func(context.Context, string) (broker.View, error) {
	return func(ctx context.Context, topic string) (broker.View, error) {
		v := &view{js: js, topic: topic}
		stream, err := js.StreamNameBySubject(topic, nats.Context(ctx))
		if err != nil {
			if errors.Is(err, nats.ErrNoMatchingStream) || errors.Is(err, nats.ErrStreamNotFound) {
				return nil, fmt.Errorf("%w (no JetStream stream captures its subject)", broker.NotFound("topic", topic))
			}
			return nil, fmt.Errorf("look up the JetStream stream of subject %q: %w", topic, err)
		}
		v.stream = stream
		if v.msgs, err = njs.Stream(ctx, stream); err != nil {
			return nil, fmt.Errorf("look up JetStream stream %q: %w", stream, err)
		}
		name := ConsumerName(group, topic)
		info, err := js.ConsumerInfo(stream, name, nats.Context(ctx))
		switch {
		case err == nil:
			v.start = info.AckFloor.Stream + 1
		case errors.Is(err, nats.ErrConsumerNotFound):
			v.start = 1 // the group's consumer, when created, delivers the whole stream
		default:
			return nil, fmt.Errorf("look up JetStream consumer %q of stream %q: %w", name, stream, err)
		}
		return v, nil
	}
}

func (v *view) List(ctx context.Context, limit int) ([]broker.Entry, error) {
	var out []broker.Entry
	for seq := v.start; len(out) < limit; {
		// The first message at or after seq on the topic's subject (the stream may capture
		// others), skipping deleted ones.
		m, err := v.msgs.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(v.topic))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break // no message at or after seq
		}
		if err != nil {
			return nil, fmt.Errorf("get message %d of stream %q: %w", seq, v.stream, err)
		}
		msg := Unmarshal(&nats.Msg{Subject: m.Subject, Data: m.Data, Header: m.Header}) // never fails
		out = append(out, broker.Entry{
			Message:   msg,
			Pos:       m.Sequence,
			PublishID: "onceflow-move:" + v.stream + ":" + strconv.FormatUint(m.Sequence, 10),
		})
		seq = m.Sequence + 1
	}
	return out, nil
}

func (v *view) Remove(ctx context.Context, e broker.Entry) error {
	seq := e.Pos.(uint64)
	err := v.js.DeleteMsg(v.stream, seq, nats.Context(ctx))
	if err != nil && !errors.Is(err, nats.ErrMsgNotFound) {
		return fmt.Errorf("delete message %d from stream %q: %w", seq, v.stream, err)
	}
	return nil
}

func (v *view) Close() error { return nil }
