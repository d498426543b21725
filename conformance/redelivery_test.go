package conformance

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// A message that fails waits its redelivery delay in the broker, not in the subscription: the
// subscribers keep many deliveries in flight, take the nack at once and delay the redelivery
// themselves (redelivery.NackAfter: a nak with a delay on JetStream), so the messages behind a
// failed one on its subscription are not held up by its delay.
func TestFailedMessageDoesNotHoldBackItsSubscription(t *testing.T) {
	for _, tc := range []struct {
		name string
		url  func(testing.TB) string
	}{{"nats", testsvc.NATSURL}, {"amqp", testsvc.AMQPURL}} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Setup{
				BrokerURL:   tc.url,
				DatabaseURL: func(t testing.TB) string { return testsvc.SQLiteURL(t) },
			}, DefaultFeatures(tc.name+"://"), PerMessage)
			b := f.openBroker(f.brokerURL)
			topic := f.topic("in")
			const delay = time.Second
			proc := processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if string(msg.Payload) == "fail" {
					return errors.New("downstream unavailable (injected)")
				}
				return writeEffect(ctx, "effects", msg)
			})
			n := f.startNode(b, nil, handlerSpec{Name: "effects", Topic: topic, Processor: proc, MaxAttempts: 1, Concurrency: 1,
				MaxDeliveries: -1, Redelivery: []time.Duration{delay}})
			failing, good := f.id("failing"), f.id("good")
			f.publish(b, topic, failing, "fail")
			f.eventually(func() bool { return n.probe.get("effects", failing).Deliveries >= 1 }, "the failing message was not delivered")
			start := time.Now()
			f.publish(b, topic, good, "ok")
			f.waitAcks(n.probe, "effects", good, 1)
			require.Less(t, time.Since(start), delay/2, "the good message waited behind the failing one's redelivery delay")
		})
	}
}
