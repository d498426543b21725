package amqp_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/messagedata"
)

// A message published again from a delivered one (a handler forwarding it, a dead letter
// replayed) does not take its delivery's headers along: a stale x-delivery-count would be read
// as the broker's count on the next first delivery.
func TestMarshaler_LeavesOutTheHeadersOfADelivery(t *testing.T) {
	t.Parallel()
	in, err := amqp.Marshaler{}.Unmarshal(amqp091.Delivery{
		Headers:     amqp091.Table{"x-delivery-count": int64(3), "k": "v", amqp.HeaderMessageUUID: "id-1"},
		MessageId:   "id-1",
		Redelivered: true,
	})
	require.NoError(t, err)
	require.Equal(t, "3", in.Metadata.Get(amqp.HeaderDeliveryCount))
	require.Equal(t, "true", in.Metadata.Get(amqp.HeaderRedelivered))

	out := message.NewMessage(in.UUID, in.Payload)
	out.Metadata = in.Metadata
	p, err := amqp.Marshaler{}.Marshal(out)
	require.NoError(t, err)
	require.Equal(t, amqp091.Table{"k": "v", amqp.HeaderMessageUUID: "id-1"}, p.Headers)
	for _, k := range []string{amqp.HeaderDeliveryCount, amqp.HeaderRedelivered, messagedata.HeaderAMQPMessageID} {
		_, has := p.Headers[k]
		require.False(t, has, k)
	}
}
