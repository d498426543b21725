package amqp_test

import (
	"math"
	"testing"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/messagedata"
)

// A message published again from a delivered one (a handler forwarding it, a dead letter
// replayed) does not take its delivery's headers along: a stale x-delivery-count would be read
// as the broker's count on the next first delivery.
func TestMarshaler_LeavesOutTheHeadersOfADelivery(t *testing.T) {
	t.Parallel()
	in, err := amqp.Marshaler{}.Unmarshal(amqp091.Delivery{
		Headers:     amqp091.Table{"x-delivery-count": int64(3), "k": "v", wamqp.DefaultMessageUUIDHeaderKey: "id-1"},
		MessageId:   "id-1",
		Redelivered: true,
	})
	require.NoError(t, err)
	require.Equal(t, "3", in.Metadata.Get(amqp.HeaderDeliveryCount))
	require.Equal(t, "true", in.Metadata.Get(broker.HeaderAMQPRedelivered))

	out := message.NewMessage(in.UUID, in.Payload)
	out.Metadata = in.Metadata
	p, err := amqp.Marshaler{}.Marshal(out)
	require.NoError(t, err)
	require.Equal(t, amqp091.Table{"k": "v", wamqp.DefaultMessageUUIDHeaderKey: "id-1"}, p.Headers)
	for _, k := range []string{amqp.HeaderDeliveryCount, broker.HeaderAMQPRedelivered, messagedata.HeaderAMQPMessageID} {
		_, has := p.Headers[k]
		require.False(t, has, k)
	}
}

func TestMarshaler_UnmarshalNeverFails(t *testing.T) {
	t.Parallel()
	d := amqp091.Delivery{
		Headers: amqp091.Table{
			"_watermill_message_uuid": int64(42), // not even the uuid header must fail
			"nil":                     nil,
			"table":                   amqp091.Table{"bytes": []byte("b"), "nested": []any{int8(1), false}},
			"float32":                 float32(0.25),
			"uint":                    uint8(7),
			"nan":                     []any{math.NaN()},
		},
		Redelivered: true,
		Body:        []byte("x"),
	}
	m, err := amqp.Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, "42", m.UUID)
	require.Equal(t, "", m.Metadata.Get("nil"))
	require.JSONEq(t, `{"bytes":"b","nested":[1,false]}`, m.Metadata.Get("table"))
	require.Equal(t, "0.25", m.Metadata.Get("float32"))
	require.Equal(t, "7", m.Metadata.Get("uint"))
	require.Equal(t, "[NaN]", m.Metadata.Get("nan"))
	require.Equal(t, "true", m.Metadata.Get(broker.HeaderAMQPRedelivered))
	_, has := m.Metadata[messagedata.HeaderTimestamp]
	require.False(t, has, "no timestamp property, no timestamp header")
}

func TestMarshaler_RoundTrip(t *testing.T) {
	t.Parallel()
	in := message.NewMessage("id-1", []byte("payload"))
	in.Metadata.Set("a", "b")
	in.Metadata.Set(messagedata.HeaderTimestamp, "2026-05-06T07:08:09.123Z")
	p, err := amqp.Marshaler{}.Marshal(in)
	require.NoError(t, err)
	out, err := amqp.Marshaler{}.Unmarshal(amqp091.Delivery{
		Headers: p.Headers, Body: p.Body, MessageId: p.MessageId, Timestamp: p.Timestamp,
	})
	require.NoError(t, err)
	require.Equal(t, in.UUID, out.UUID)
	require.Equal(t, "b", out.Metadata.Get("a"))
	require.Equal(t, "2026-05-06T07:08:09.123Z", out.Metadata.Get(messagedata.HeaderTimestamp), "the header wins over the whole-second property")
	require.Equal(t, "id-1", out.Metadata.Get(messagedata.HeaderAMQPMessageID))

	noID := message.NewMessage("", nil)
	noID.Metadata.Set(messagedata.HeaderAMQPMessageID, "carried")
	p, err = amqp.Marshaler{}.Marshal(noID)
	require.NoError(t, err)
	require.Equal(t, "carried", p.MessageId, "a message without UUID keeps the message_id it came with")
	_, has := p.Headers["_watermill_message_uuid"]
	require.False(t, has)
}

// A string header costs no allocation of its own: the headers of most deliveries are strings.
func TestMarshaler_UnmarshalTakesStringHeadersAsTheyAre(t *testing.T) {
	bare := amqp091.Delivery{MessageId: "id-1", Body: []byte("x")}
	withHeaders := bare
	withHeaders.Headers = amqp091.Table{wamqp.DefaultMessageUUIDHeaderKey: "id-1", "a": "value-a", "b": "value-b", "c": "value-c"}
	m, err := amqp.Marshaler{}.Unmarshal(withHeaders)
	require.NoError(t, err)
	require.Equal(t, "id-1", m.UUID)
	require.Equal(t, "value-c", m.Metadata.Get("c"))
	allocs := func(d amqp091.Delivery) float64 {
		return testing.AllocsPerRun(100, func() { _, _ = amqp.Marshaler{}.Unmarshal(d) })
	}
	require.Equal(t, allocs(bare), allocs(withHeaders))
}
