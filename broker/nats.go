package broker

import (
	"context"
	"fmt"
	"strings"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/messagedata"
)

func openNATS(t *target, o Options) (*backend, error) {
	nc, err := nats.Connect(t.dsn, nats.Name("onceflow publisher"))
	if err != nil {
		return nil, err
	}
	js, err := nc.JetStream()
	if err == nil {
		_, err = js.AccountInfo()
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("JetStream is not available: %w", err)
	}
	pub, err := wnats.NewPublisherWithNatsConn(nc, wnats.PublisherPublishConfig{
		Marshaler:         natsMarshaler{},
		SubjectCalculator: wnats.DefaultSubjectCalculator,
		// natsMarshaler sets Nats-Msg-Id (the message UUID, or HeaderNATSMsgID): JetStream drops
		// a second publish of the same message within the stream's duplicate window, so a
		// publisher that retries does not duplicate. TrackMsgId would overwrite it with the UUID.
		JetStream: wnats.JetStreamConfig{TrackMsgId: false},
	}, o.Logger)
	if err != nil {
		nc.Close()
		return nil, err
	}
	njs, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	streams := natsbroker.NewStreams(njs)
	cfg := natsbroker.Config{
		URL:           t.dsn,
		ConsumerGroup: o.ConsumerGroup,
		Prefetch:      o.Prefetch,
		AckWait:       o.AckTimeout,
		NackDelay:     o.nackDelay(),
		Logger:        o.Logger,
	}

	return &backend{
		pub:        pub,
		checkTopic: checkNATSTopic,
		preparePublish: func(topic string) error {
			_, err := streams.Ensure(context.Background(), topic)
			return err
		},
		// The subscriber pulls many deliveries in flight per subscription, delays nacks with
		// NakWithDelay, naks what it holds when it closes and counts deliveries with
		// JetStream's NumDelivered.
		newSubscriber: func() (message.Subscriber, error) { return natsbroker.NewSubscriber(cfg) },
		native:        true,
		close: func() error {
			nc.Close()
			return nil
		},
		view: newNATSView(nc, js, o.ConsumerGroup),
	}, nil
}

// checkNATSTopic accepts topics that are literal NATS subjects. A '.' separates subject tokens:
// "orders.created" is the subject orders.created, which a stream for "orders.*" would capture.
func checkNATSTopic(topic string) error {
	if strings.ContainsAny(topic, "*> \t\r\n") {
		return fmt.Errorf("broker: topic %q: a NATS topic is a literal subject: no spaces and no wildcards (* >)", topic)
	}
	if strings.HasPrefix(topic, ".") || strings.HasSuffix(topic, ".") || strings.Contains(topic, "..") {
		return fmt.Errorf("broker: topic %q: a NATS topic is a subject of non-empty tokens separated by '.'", topic)
	}
	return nil
}

// HeaderNATSMsgID, set on a message published to a NATS broker, is the Nats-Msg-Id the message
// is published with, in place of its UUID. JetStream drops a publish whose Nats-Msg-Id the
// stream has seen within its duplicate window (2 minutes by default): a message that must be
// published again with the same UUID within that window, such as a dead letter moved back to
// the topic it came from, needs an id of its own. Broker.Move sets it. The header itself is not
// sent; other schemes ignore it.
const HeaderNATSMsgID = "onceflow_nats_msg_id"

// natsMsgID returns the Nats-Msg-Id of msg: HeaderNATSMsgID when set; for a dead letter (a
// message with the header messagedata.HeaderDeadLetterTime), its UUID with the handler and the
// time it was dead-lettered, so that a message dead-lettered again (replayed, failed again)
// within the duplicate window is not dropped from the dead-letter topic, and lost, while a
// retried publish of one dead letter still is; otherwise the UUID.
func natsMsgID(msg *message.Message) string {
	if id := msg.Metadata.Get(HeaderNATSMsgID); id != "" {
		return id
	}
	if at := msg.Metadata.Get(messagedata.HeaderDeadLetterTime); at != "" && msg.UUID != "" {
		return msg.UUID + "|dead-letter|" + msg.Metadata.Get(messagedata.HeaderDeadLetterHandler) + "|" + at
	}
	return msg.UUID
}

// natsMarshaler is the wire format of the NATS scheme: watermill-nats's NATSMarshaler for the
// publisher, with Nats-Msg-Id set as natsMsgID says, and the tolerant natsbroker.Unmarshal of
// the subscriber for Peek and Move, which never fails on foreign headers.
type natsMarshaler struct{}

var _ wnats.MarshalerUnmarshaler = natsMarshaler{}

// Marshal converts msg to a NATS message with the metadata as headers, and Nats-Msg-Id set as
// natsMsgID says.
func (natsMarshaler) Marshal(topic string, msg *message.Message) (*nats.Msg, error) {
	md := make(message.Metadata, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if strings.ContainsAny(k, "\r\n: ") || strings.ContainsAny(v, "\r\n") {
			return nil, fmt.Errorf("metadata %q: NATS headers cannot carry line breaks, nor ':' or spaces in names", k)
		}
		if k != HeaderNATSMsgID {
			md[k] = v
		}
	}
	out := message.NewMessage(msg.UUID, msg.Payload)
	out.Metadata = md
	m, err := (&wnats.NATSMarshaler{}).Marshal(topic, out)
	if err != nil {
		return nil, err
	}
	if id := natsMsgID(msg); id != "" {
		m.Header.Set(nats.MsgIdHdr, id)
	}
	return m, nil
}

// Unmarshal converts a NATS message to a watermill message as natsbroker.Unmarshal does: it
// never fails.
func (natsMarshaler) Unmarshal(m *nats.Msg) (*message.Message, error) {
	return natsbroker.Unmarshal(m), nil
}
