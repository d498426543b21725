package conformance

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// TestDeadLetterIsNotPublishedAgainWhenItsAckIsLost: a message that fails permanently is
// published to the dead-letter topic and then acknowledged; when the acknowledgement is lost
// (its consumer dies, or its connection drops, between the two) the broker delivers the message
// again. The router recorded the dead letter in the delivery counter table after publishing
// it, so the redelivery is acknowledged without a second one. (A consumer that dies between the
// publish and the record still publishes it again.)
func TestDeadLetterIsNotPublishedAgainWhenItsAckIsLost(t *testing.T) {
	brokerURL := "mem://" + testsvc.UniqueName("deadletter")
	f := newFixture(t, Setup{
		BrokerURL:   func(testing.TB) string { return brokerURL },
		DatabaseURL: func(t testing.TB) string { return testsvc.SQLiteURL(t) },
	}, DefaultFeatures(brokerURL), PerMessage)
	b := f.openBroker(f.brokerURL)
	dead := f.collectDeadLetters(b)
	topic := f.topic("in")

	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(), DeadLetterTopic: f.dlq, Logger: f.logger, PurgeInterval: -1, CloseTimeout: 5 * time.Second,
	})
	require.NoError(t, err)
	var lost sync.Once
	// Outside "deadletter": the dead letter is out, and the acknowledgement is lost once.
	interceptor(t, r, "lose-first-ack", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			lose := false
			if processor.IsDeadLettered(err) {
				lost.Do(func() { lose = true })
			}
			if lose {
				return errAckLost
			}
			return err
		})
	})
	sub, err := b.Subscriber()
	require.NoError(t, err)
	p := newProbe(t)
	h := f.handler(handlerSpec{Name: "effects", Topic: topic, Processor: processor.Func(func(context.Context, *messagedata.MessageData) error {
		return processor.Permanent(errors.New("rejected by a business rule"))
	})}, p.wrap("effects", sub))
	h.Interceptors = []string{onceflow.InterceptorTracing, onceflow.InterceptorMetrics, "lose-first-ack", onceflow.InterceptorDeadLetter,
		onceflow.InterceptorRecover, onceflow.InterceptorRetry, onceflow.InterceptorTransaction, onceflow.InterceptorDeduplicate}
	require.NoError(t, r.AddHandler(h))
	testsvc.StartRouter(t, r)

	id := f.id("rejected")
	f.publish(b, topic, id, "x")
	f.waitAcks(p, "effects", id, 1)
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, deliveryCounts{Deliveries: 2, Acks: 1, Nacks: 1}, p.get("effects", id), "the delivery whose ack was lost, then its redelivery")
	require.Len(t, dead.all(), 1, "dead-lettered once, although delivered twice")
}
