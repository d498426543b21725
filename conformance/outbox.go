package conformance

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
)

// This file is the Outbox scenario: messages written in the handler's transaction reach their
// consumer once, through a relay whose publisher reports some publishes as failed after the
// broker took them.

// flakyPublisher publishes to the destination broker, and reports every Nth publish as failed
// although the broker has the message: the failure an outbox relay meets when the connection
// drops before the broker's confirm arrives. The relay then sends the message again.
type flakyPublisher struct {
	inner message.Publisher
	every int

	mu        sync.Mutex
	calls     int
	failures  int
	published map[string]int // messages the broker took, by UUID
	confirmed map[string]int // publishes reported as successful, by UUID
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.inner.Publish(topic, msgs...); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.published[m.UUID]++
	}
	p.calls++
	if p.calls%p.every == 0 {
		p.failures++
		return errors.New("connection lost before the publisher confirm (injected)")
	}
	for _, m := range msgs {
		p.confirmed[m.UUID]++
	}
	return nil
}

func (p *flakyPublisher) Close() error { return nil }

func (p *flakyPublisher) counts(id string) (published, confirmed int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.published[id], p.confirmed[id]
}

// testOutbox: handler "orders" writes an effect and an outgoing message through the outbox in
// its transaction; a relay sends the outbox to the broker through a publisher that reports
// every second publish as failed after the broker took it; handler "shipping" consumes the
// outgoing messages.
//
// Rollback: an order that fails permanently after its outbox write is dead-lettered with the
// reason, and its outgoing message is never sent: its outbox row rolled back, which is checked
// once the outgoing messages of later orders have arrived.
//
// Commit: each later order's outgoing message reaches "shipping" at least once (twice where the
// relay sent it again and the broker does not drop a second publish of a UUID), and has one
// effect there.
func testOutbox(t *testing.T, f *fixture) {
	b := f.openBroker(f.brokerURL)
	in, out := f.topic("orders"), f.topic("shipping")
	dead := f.collectDeadLetters(b)
	ob, err := outbox.New(f.db, outbox.Config{Table: "conformance_outbox"})
	require.NoError(t, err)
	orders := processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		if err := writeEffect(ctx, "orders", msg); err != nil {
			return err
		}
		shipment := message.NewMessage(outbox.DerivedID(msg.ID, "shipment"), msg.Payload)
		if err := ob.Publish(ctx, out, shipment); err != nil {
			return err
		}
		if string(msg.Payload) == "reject" {
			return processor.Permanent(errors.New("order rejected by a business rule"))
		}
		return nil
	})
	n := f.startNode(b, func(r *onceflow.Router) { r.AddMigration(ob.Migrate) },
		handlerSpec{Name: "orders", Topic: in, Processor: orders},
		handlerSpec{Name: "shipping", Topic: out})

	dest := &flakyPublisher{inner: b.Publisher(), every: 2, published: map[string]int{}, confirmed: map[string]int{}}
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: f.db, Publisher: dest, Table: ob.Table(), Logger: f.logger,
		PollInterval: 10 * time.Millisecond, ResendInterval: 20 * time.Millisecond, RetryInterval: 100 * time.Millisecond,
	})
	require.NoError(t, err)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, relay.Close())
		require.NoError(t, <-relayDone)
	})

	t.Run("Rollback", func(t *testing.T) {
		rejected := f.id("rejected")
		f.publish(b, in, rejected, "reject")
		f.eventually(func() bool { return len(dead.all()) >= 1 }, "the rejected order was not dead-lettered")
		require.Len(t, dead.all(), 1)
		dl := dead.all()[0]
		require.Equal(t, rejected, dl.UUID)
		require.Contains(t, dl.Metadata.Get(messagedata.HeaderDeadLetterReason), "order rejected by a business rule")
		require.Equal(t, "orders", dl.Metadata.Get(messagedata.HeaderDeadLetterHandler))
		require.Equal(t, in, dl.Metadata.Get(messagedata.HeaderDeadLetterTopic))
		f.waitAcks(n.probe, "orders", rejected, 1)
		require.Equal(t, deliveryCounts{Deliveries: 1, Acks: 1}, n.probe.get("orders", rejected), "dead-lettered, then acked")
		require.Equal(t, 0, f.effects("orders", rejected), "the rejected order's effect rolled back")
	})

	t.Run("Commit", func(t *testing.T) {
		const orderCount = 4
		var ids, shipments []string
		for i := range orderCount {
			id := f.id(fmt.Sprintf("order%d", i))
			ids = append(ids, id)
			shipments = append(shipments, outbox.DerivedID(id, "shipment"))
			f.publish(b, in, id, fmt.Sprintf("order %d", i))
		}
		// Once the relay has a confirmed publish of a shipment it sends it no more: its
		// deliveries are then final.
		for i, s := range shipments {
			f.eventually(func() bool { _, confirmed := dest.counts(s); return confirmed >= 1 }, "the relay did not send the shipment of %s", ids[i])
		}
		for i, s := range shipments {
			published, _ := dest.counts(s)
			want := published
			if f.features.DeduplicatesPublishes {
				want = 1 // the broker dropped the resend
			}
			f.waitAcks(n.probe, "shipping", s, want)
			require.Equal(t, deliveryCounts{Deliveries: want, Acks: want}, n.probe.get("shipping", s), "shipment of %s: every publish delivered and acked", ids[i])
			require.Equal(t, 1, f.effects("shipping", s), "shipment of %s: one effect downstream", ids[i])
			require.Equal(t, 1, f.effects("orders", ids[i]), "order %s: one effect", ids[i])
			// Not nacked: its Publish never waited for the relay, which holds its batch open
			// while the broker takes a message.
			require.Equal(t, deliveryCounts{Deliveries: 1, Acks: 1}, n.probe.get("orders", ids[i]), "order %s", ids[i])
		}
		dest.mu.Lock()
		failures := dest.failures
		resent := 0
		for _, s := range shipments {
			if dest.published[s] > 1 {
				resent++
			}
		}
		dest.mu.Unlock()
		require.GreaterOrEqual(t, failures, orderCount/2, "the relay's publisher reported failures")
		require.GreaterOrEqual(t, resent, 1, "the relay sent a shipment again")

		// The rejected order's shipment was never written, so never sent.
		rejectedShipment := outbox.DerivedID(f.id("rejected"), "shipment")
		published, _ := dest.counts(rejectedShipment)
		require.Equal(t, 0, published, "the rolled-back outbox message was sent")
		require.Equal(t, deliveryCounts{}, n.probe.get("shipping", rejectedShipment))
		require.Equal(t, 0, f.effects("shipping", rejectedShipment))
		t.Logf("relay: %d publishes reported failed, %d of %d shipments sent twice; %d dead letters",
			failures, resent, orderCount, len(dead.all()))
	})
}
