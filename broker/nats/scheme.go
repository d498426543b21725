package nats

import (
	"context"
	"fmt"
	"strings"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/wmlog"
	"github.com/onceflow/onceflow/messagedata"
)

// nats.go reads no query parameter of a URL: the scheme takes only those of every scheme.
func init() { broker.Register("nats", openScheme, broker.Params{}) }

// openScheme publishes with watermill-nats's publisher, with Nats-Msg-Id set as msgID says,
// and subscribes with this package's Subscriber. Every connect (INFO, CONNECT and PING
// included) and the check that JetStream is enabled are bounded by opts.ConnectTimeout.
func openScheme(ctx context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	nc, err := nats.Connect(t.URL, nats.Name("onceflow publisher"), nats.Timeout(o.ConnectTimeout))
	if err != nil {
		return nil, err
	}
	js, err := nc.JetStream()
	if err == nil {
		checkCtx, cancel := context.WithTimeout(ctx, o.ConnectTimeout)
		_, err = js.AccountInfo(nats.Context(checkCtx))
		cancel()
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("JetStream is not available: %w", err)
	}
	pub, err := wnats.NewPublisherWithNatsConn(nc, wnats.PublisherPublishConfig{
		Marshaler:         marshaler{},
		SubjectCalculator: wnats.DefaultSubjectCalculator,
		// marshaler sets Nats-Msg-Id (msgID), so that JetStream drops a retried publish
		// within the stream's duplicate window; TrackMsgId would overwrite it with the UUID.
		JetStream: wnats.JetStreamConfig{TrackMsgId: false},
	}, wmlog.Adapter(o.Logger))
	if err != nil {
		nc.Close()
		return nil, err
	}
	njs, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	streams := NewStreams(njs)
	cfg := Config{
		URL:           t.URL,
		ConsumerGroup: o.ConsumerGroup,
		Prefetch:      o.Prefetch,
		AckWait:       o.AckTimeout,
		NackDelay:     max(o.NackDelay, 0),
		Logger:        o.Logger,
		// A Subscriber's connection, and its reconnections, are bounded alike.
		ConnectOptions: []nats.Option{nats.Timeout(o.ConnectTimeout)},
	}

	return &broker.Backend{
		Publisher:  pub,
		CheckTopic: checkTopic,
		PreparePublish: func(topic string) error {
			_, err := streams.Ensure(context.Background(), topic)
			return err
		},
		// The subscriber pulls many deliveries in flight per subscription, delays nacks with
		// NakWithDelay, naks what it holds when it closes and counts deliveries with
		// JetStream's NumDelivered.
		NewSubscriber: func() (message.Subscriber, error) { return NewSubscriber(cfg) },
		Close: func() error {
			nc.Close()
			return nil
		},
		View: newView(js, njs, o.ConsumerGroup),
	}, nil
}

// checkTopic accepts topics that are literal NATS subjects. A '.' separates subject tokens:
// "orders.created" is the subject orders.created, which a stream for "orders.*" would capture.
func checkTopic(topic string) error {
	if strings.ContainsAny(topic, "*> \t\r\n") {
		return fmt.Errorf("broker: topic %q: a NATS topic is a literal subject: no spaces and no wildcards (* >)", topic)
	}
	if strings.HasPrefix(topic, ".") || strings.HasSuffix(topic, ".") || strings.Contains(topic, "..") {
		return fmt.Errorf("broker: topic %q: a NATS topic is a subject of non-empty tokens separated by '.'", topic)
	}
	return nil
}

// msgID returns the Nats-Msg-Id of msg: broker.HeaderNATSMsgID when set; for a dead letter,
// its key (messagedata.HeaderDeadLetterKey), so that JetStream drops the dead letter that a
// consumer publishes again after its predecessor died before recording it, and keeps one of a
// replay, whose key differs; for a dead letter without a key (an earlier version's), its UUID
// with the handler and the time it was dead-lettered; otherwise the UUID.
func msgID(msg *message.Message) string {
	if id := msg.Metadata.Get(broker.HeaderNATSMsgID); id != "" {
		return id
	}
	if key := msg.Metadata.Get(messagedata.HeaderDeadLetterKey); key != "" {
		return "dead-letter|" + key
	}
	if at := msg.Metadata.Get(messagedata.HeaderDeadLetterTime); at != "" && msg.UUID != "" {
		return msg.UUID + "|dead-letter|" + msg.Metadata.Get(messagedata.HeaderDeadLetterHandler) + "|" + at
	}
	return msg.UUID
}

// marshaler is the wire format of the nats:// scheme: watermill-nats's NATSMarshaler for the
// publisher, with Nats-Msg-Id set as msgID says, and the tolerant Unmarshal of the subscriber
// for Peek and Move, which never fails on foreign headers.
type marshaler struct{}

var _ wnats.MarshalerUnmarshaler = marshaler{}

// Marshal converts msg to a NATS message with the metadata as headers, and Nats-Msg-Id set as
// msgID says.
func (marshaler) Marshal(topic string, msg *message.Message) (*nats.Msg, error) {
	md := make(message.Metadata, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if strings.ContainsAny(k, "\r\n: ") || strings.ContainsAny(v, "\r\n") {
			return nil, fmt.Errorf("metadata %q: NATS headers cannot carry line breaks, nor ':' or spaces in names", k)
		}
		if k != broker.HeaderNATSMsgID {
			md[k] = v
		}
	}
	out := message.NewMessage(msg.UUID, msg.Payload)
	out.Metadata = md
	m, err := (&wnats.NATSMarshaler{}).Marshal(topic, out)
	if err != nil {
		return nil, err
	}
	if id := msgID(msg); id != "" {
		m.Header.Set(nats.MsgIdHdr, id)
	}
	return m, nil
}

// Unmarshal converts a NATS message to a watermill message as the package's Unmarshal does:
// it never fails.
func (marshaler) Unmarshal(m *nats.Msg) (*message.Message, error) {
	return Unmarshal(m), nil
}
