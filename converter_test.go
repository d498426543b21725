package onceflow_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// A foreign producer sends the same order twice, each time under a new message UUID: with the
// id taken from the payload's business key, the order is applied once.
func TestExactlyOnce_BusinessKeyFromThePayloadIsTheID(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce,
			Converter: converter.New(converter.Config{ID: converter.JSONField("order_id")})})

		for _, uuid := range []string{"send-1", "send-2"} {
			require.NoError(t, f.broker.Publish(topic, message.NewMessage(uuid, []byte(`{"order_id": "ord-9"}`))))
			f.waitAcks(t, uuid, 1)
		}
		require.Equal(t, 1, countEffects(t, f.db, "ord-9"), "one effect for the order, keyed by its id")
		require.Equal(t, 1, countDedup(t, f.db, "ord-9"))

		require.NoError(t, f.broker.Publish(topic, message.NewMessage("send-3", []byte(`{"no_order": true}`))))
		f.waitAcks(t, "send-3", 1)
		dead := f.broker.Drain(onceflow.DefaultDeadLetterTopic)
		require.Len(t, dead, 1)
		require.Contains(t, dead[0].Metadata.Get("onceflow_dlq_reason"), `id field "order_id": "order_id" is missing`)
	})
}

func TestHandler_IDHeaderWithConverterIsRefused(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1})
	require.NoError(t, err)
	err = r.AddHandler(onceflow.Handler{Name: "h", Topic: topic, DB: f.db, Subscriber: f.broker.Subscriber(), QoS: onceflow.ExactlyOnce,
		Processor: processor.Func(applyEffect), IDHeader: "x-id", Converter: converter.New(converter.Config{})})
	require.ErrorContains(t, err, "Handler.IDHeader: set together with Converter")
}

// A foreign producer sets no message id at all; its payload carries a business key. With the
// id taken from there, two deliveries of the same payload apply once, and another key is
// another message (id-less messages do not collapse onto one empty key).
func TestExactlyOnce_IDLessMessagesAreKeyedByThePayloadsBusinessKey(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce,
			Converter: converter.New(converter.Config{ID: converter.JSONField("order.id")})})

		for i, payload := range []string{`{"order": {"id": "ord-7"}}`, `{"order": {"id": "ord-7"}}`, `{"order": {"id": "ord-8"}}`} {
			require.NoError(t, f.broker.Publish(topic, message.NewMessage("", []byte(payload))))
			f.waitAcks(t, "", i+1)
		}
		require.Equal(t, 1, countEffects(t, f.db, "ord-7"), "the redelivered payload is applied once")
		require.Equal(t, 1, countDedup(t, f.db, "ord-7"))
		require.Equal(t, 1, countEffects(t, f.db, "ord-8"))
		require.Equal(t, 0, f.broker.Nacks(""))
		require.Empty(t, f.broker.Drain(onceflow.DefaultDeadLetterTopic))
	})
}

// csvConverter is a converter of a user's own, for a producer that sends "<order id>;<amount>"
// lines without a message id.
type csvConverter struct{ next converter.MessageConverter }

func (c csvConverter) FromMessage(topic string, msg *message.Message) (*messagedata.MessageData, error) {
	key, _, ok := strings.Cut(string(msg.Payload), ";")
	if !ok || key == "" {
		return nil, fmt.Errorf("%w (payload %q has no order id)", messagedata.ErrNoMessageID, msg.Payload)
	}
	md, err := c.next.FromMessage(topic, msg)
	if md != nil {
		md.ID = key
	}
	if errors.Is(err, messagedata.ErrNoMessageID) {
		err = nil // the payload's order id stands in for the missing one
	}
	return md, err
}

// Handler.Converter takes a converter of the user's own: an id-less message in a format of its
// own is processed exactly once by the key the converter reads.
func TestExactlyOnce_AUsersConverterSaysTheID(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, Converter: csvConverter{next: converter.New(converter.Config{})}})

	for i := range 2 {
		require.NoError(t, f.broker.Publish(topic, message.NewMessage("", []byte("ord-5;12.50"))))
		f.waitAcks(t, "", i+1)
	}
	require.Equal(t, 1, countEffects(t, f.db, "ord-5"))
	require.Equal(t, 1, countDedup(t, f.db, "ord-5"))

	require.NoError(t, f.broker.Publish(topic, message.NewMessage("", []byte("no key"))))
	f.waitAcks(t, "", 3)
	dead := f.broker.Drain(onceflow.DefaultDeadLetterTopic)
	require.Len(t, dead, 1)
	require.Contains(t, dead[0].Metadata.Get("onceflow_dlq_reason"), `payload "no key" has no order id`)
}
