package onceflow_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
)

// A trace goes producer -> "orders" handler -> outbox row, committed with the handler's writes
// -> relay -> broker -> "shipments" handler, in one trace: the outgoing message's parent is the
// span that published it, the orders handler's onceflow.process span.
func TestTracing_TraceContinuesAcrossTheOutboxRelay(t *testing.T) {
	o := newObserved(t)
	ob, err := outbox.New(o.db, outbox.Config{Propagator: traceContext})
	require.NoError(t, err)
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: o.db, Publisher: o.broker, PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)

	orders := onceflow.Handler{
		Name:  "effects",
		Topic: topic,
		QoS:   onceflow.ExactlyOnce,
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if err := applyEffect(ctx, msg); err != nil {
				return err
			}
			return ob.Publish(ctx, "shipments", message.NewMessage(outbox.DerivedID(msg.ID, "shipment"), []byte(`{"ship":true}`)))
		}),
	}
	shipments := onceflow.Handler{
		Name:      "shipments",
		Topic:     "shipments",
		QoS:       onceflow.ExactlyOnce,
		Processor: processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }),
	}
	o.startHandlers(t, []func(*onceflow.Router){func(r *onceflow.Router) { r.AddMigration(ob.Migrate) }}, orders, shipments)

	ctx, cancel := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-relayDone)
	})

	producer := o.produce(t, "m-1", "a")
	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range o.waitDeliveries(t, 2) {
		byName[s.Name()] = s
	}
	ordersSpan, shipmentsSpan := byName["process orders"], byName["process shipments"]
	require.NotNil(t, ordersSpan)
	require.NotNil(t, shipmentsSpan)
	require.Equal(t, producer.SpanID(), ordersSpan.Parent().SpanID())

	publisher := o.childrenOf(ordersSpan)["onceflow.process"]
	require.NotNil(t, publisher)
	require.Equal(t, producer.TraceID(), shipmentsSpan.SpanContext().TraceID(), "one trace across the outbox hop")
	require.Equal(t, publisher.SpanContext().SpanID(), shipmentsSpan.Parent().SpanID(),
		"the relayed message's parent is the span that called outbox.Publish")
	require.True(t, shipmentsSpan.Parent().IsRemote())
	require.Equal(t, trace.SpanKindConsumer, shipmentsSpan.SpanKind())
	require.Equal(t, "shipments", attrs(shipmentsSpan)["onceflow.handler"].AsString())
	require.Equal(t, outbox.DerivedID("m-1", "shipment"), attrs(shipmentsSpan)["messaging.message.id"].AsString())
}
