package broker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

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
	streams := &natsStreams{js: js, known: map[string]string{}}
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
			_, err := streams.ensure(topic)
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
			name := func(_, topic string) string { return natsConsumerName(group, topic) }
			up, err := wnats.NewSubscriberWithNatsConn(snc, wnats.SubscriberSubscriptionConfig{
				Unmarshaler:      natsMarshaler{},
				SubscribersCount: 1,
				AckWaitTimeout:   o.AckTimeout,
				CloseTimeout:     natsCloseTimeout,
				SubjectCalculator: func(_, topic string) *wnats.SubjectDetail {
					return &wnats.SubjectDetail{Primary: topic, QueueGroup: natsConsumerName(group, topic)}
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
			streams := &natsStreams{js: sjs, known: map[string]string{}}
			return &natsSubscriber{Subscriber: up, streams: streams, group: group, consumer: consumer}, nil
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

// natsName turns s into a valid JetStream stream or consumer name: s itself when it has only
// letters, digits, '-' and '_'; otherwise s with the other characters replaced by '_' and a
// hash of s appended, so that different topics never share a name.
func natsName(s string) string {
	clean := true
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '_'
			clean = false
		}
	}
	if clean {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return string(b) + "_" + hex.EncodeToString(sum[:4])
}

// natsConsumerName names the durable consumer (and its deliver group) of a consumer group on a
// topic.
func natsConsumerName(group, topic string) string { return natsName(group + "_" + topic) }

// natsStreams finds or creates the JetStream stream that stores a topic.
type natsStreams struct {
	js nats.JetStreamContext

	mu    sync.Mutex
	known map[string]string // topic -> stream
}

// ensure returns the stream that captures topic's subject, creating one named after the topic
// (file storage, limits retention: messages stay until the stream's limits remove them, so
// every consumer group can read them) when none does.
func (s *natsStreams) ensure(topic string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if name, ok := s.known[topic]; ok {
		return name, nil
	}
	name, err := s.js.StreamNameBySubject(topic)
	if err != nil {
		name = natsName(topic)
		_, err = s.js.AddStream(&nats.StreamConfig{
			Name:      name,
			Subjects:  []string{topic},
			Storage:   nats.FileStorage,
			Retention: nats.LimitsPolicy,
		})
		if err != nil {
			// Another process may have created it in the meantime.
			if found, err2 := s.js.StreamNameBySubject(topic); err2 == nil {
				name, err = found, nil
			}
		}
		if err != nil {
			return "", fmt.Errorf("create JetStream stream %q for subject %q: %w", name, topic, err)
		}
	}
	s.known[topic] = name
	return name, nil
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
	streams  *natsStreams
	group    string
	consumer natsConsumer
}

// Subscribe ensures the stream and the durable consumer, then joins the consumer's deliver
// group.
func (s *natsSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	stream, err := s.streams.ensure(topic)
	if err != nil {
		return nil, err
	}
	name := natsConsumerName(s.group, topic)
	js := s.streams.js
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

// Unmarshal converts a NATS message to a watermill message. The UUID is the header
// "_watermill_message_uuid", or the Nats-Msg-Id header of a producer that sets only that. A
// header with several values becomes a JSON array.
func (natsMarshaler) Unmarshal(m *nats.Msg) (*message.Message, error) {
	id := m.Header.Get(wnats.WatermillUUIDHdr)
	if id == "" {
		id = m.Header.Get(nats.MsgIdHdr)
	}
	md := make(message.Metadata, len(m.Header))
	for k, vs := range m.Header {
		switch k {
		case wnats.WatermillUUIDHdr, nats.MsgIdHdr, nats.ExpectedLastMsgIdHdr, nats.ExpectedStreamHdr,
			nats.ExpectedLastSubjSeqHdr, nats.ExpectedLastSeqHdr:
			continue
		}
		switch len(vs) {
		case 0:
			md[k] = ""
		case 1:
			md[k] = vs[0]
		default:
			b, _ := json.Marshal(vs)
			md[k] = string(b)
		}
	}
	msg := message.NewMessage(id, m.Data)
	msg.Metadata = md
	return msg, nil
}
