package onceflow_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/internal/testsvc"
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
