package broker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/messagedata"
)

// natsCloseTimeout bounds how long a closing NATS subscriber waits for its subscriptions.
const natsCloseTimeout = 10 * time.Second

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
	group := o.ConsumerGroup
	var nak wnats.Delay
	if d := o.nackDelay(); d > 0 {
		nak = wnats.NewStaticDelay(d)
	}
	consumer := natsConsumer{ackWait: o.AckTimeout, maxAckPending: o.Prefetch}

	return &backend{
		pub:        pub,
		checkTopic: checkNATSTopic,
		preparePublish: func(topic string) error {
			_, err := streams.Ensure(context.Background(), topic)
			return err
		},
		newSubscriber: func() (message.Subscriber, error) {
			snc, err := nats.Connect(t.dsn, nats.Name("onceflow subscriber "+group))
			if err != nil {
				return nil, err
			}
			sjs, err := snc.JetStream()
			if err != nil {
				snc.Close()
				return nil, err
			}
			name := func(_, topic string) string { return natsbroker.ConsumerName(group, topic) }
			up, err := wnats.NewSubscriberWithNatsConn(snc, wnats.SubscriberSubscriptionConfig{
				Unmarshaler:      natsMarshaler{},
				SubscribersCount: 1,
				AckWaitTimeout:   o.AckTimeout,
				CloseTimeout:     natsCloseTimeout,
				SubjectCalculator: func(_, topic string) *wnats.SubjectDetail {
					return &wnats.SubjectDetail{Primary: topic, QueueGroup: natsbroker.ConsumerName(group, topic)}
				},
				NakDelay: nak,
				JetStream: wnats.JetStreamConfig{
					// Without ManualAck, nats.go acks every message when the callback returns,
					// even one that was never processed.
					SubscribeOptions:  []nats.SubOpt{nats.ManualAck()},
					DurableCalculator: name,
					AckAsync:          false,
				},
				QueueGroupPrefix: group,
			}, o.Logger)
			if err != nil {
				snc.Close()
				return nil, err
			}
			snjs, err := jetstream.New(snc)
			if err != nil {
				snc.Close()
				return nil, err
			}
			streams := natsbroker.NewStreams(snjs)
			return &natsSubscriber{Subscriber: up, js: sjs, streams: streams, group: group, consumer: consumer}, nil
		},
		// Nak with a delay is native; a closing consumer naks what it holds, so that the
		// message does not wait for AckWait.
		nackOnClose: true,
		close: func() error {
			nc.Close()
			return nil
		},
		view: newNATSView(nc, js, group),
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

// natsConsumer is the configuration of the durable consumers onceflow creates.
type natsConsumer struct {
	ackWait       time.Duration
	maxAckPending int
}

// natsSubscriber creates the stream and the consumer group's durable consumer before
// watermill-nats subscribes. It creates the consumer itself, because nats.go deletes a
// consumer that a subscription created when that subscription ends, durable or not: the group
// would lose its position, and its other members their consumer.
type natsSubscriber struct {
	*wnats.Subscriber
	js       nats.JetStreamContext
	streams  *natsbroker.Streams
	group    string
	consumer natsConsumer
}

// Subscribe ensures the stream and the durable consumer, then joins the consumer's deliver
// group.
func (s *natsSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	stream, err := s.streams.Ensure(ctx, topic)
	if err != nil {
		return nil, err
	}
	name := natsbroker.ConsumerName(s.group, topic)
	js := s.js
	if _, err := js.ConsumerInfo(stream, name); err != nil {
		if !errors.Is(err, nats.ErrConsumerNotFound) {
			return nil, fmt.Errorf("look up JetStream consumer %q of stream %q: %w", name, stream, err)
		}
		_, err = js.AddConsumer(stream, &nats.ConsumerConfig{
			Durable:        name,
			DeliverSubject: nats.NewInbox(),
			DeliverGroup:   name,
			DeliverPolicy:  nats.DeliverAllPolicy,
			AckPolicy:      nats.AckExplicitPolicy,
			AckWait:        s.consumer.ackWait,
			MaxDeliver:     -1,
			MaxAckPending:  s.consumer.maxAckPending,
			FilterSubject:  topic,
		})
		if err != nil {
			// Another member of the group may have created it in the meantime.
			if _, err2 := js.ConsumerInfo(stream, name); err2 != nil {
				return nil, fmt.Errorf("create JetStream consumer %q of stream %q: %w", name, stream, err)
			}
		}
	}
	return s.Subscriber.Subscribe(ctx, topic)
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

// natsMarshaler is watermill-nats's NATSMarshaler with a tolerant Unmarshal: it never fails, so
// that no message is left unacknowledged for its headers (watermill-nats drops a message it
// cannot unmarshal without acking it, and JetStream redelivers it after every AckWait).
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
