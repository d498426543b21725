package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	kafkabroker "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// subscribeDirect subscribes s to the fixture's topic as a consumer that settles each message
// itself (redelivery.WithDirectSettle).
func (f *fixture) subscribeDirect(s *kafkabroker.Subscriber) <-chan *message.Message {
	f.t.Helper()
	ch, err := s.Subscribe(redelivery.WithDirectSettle(context.Background()), f.topic)
	require.NoError(f.t, err)
	return ch
}

func TestSubscriber_DirectSettleBooksTheAckWhenTheConsumerSettles(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	f.publish(0, 2)
	ch := f.subscribeDirect(f.subscriber(kafkabroker.Config{}))
	first := receive(t, ch, within)
	first.Ack()
	second := receive(t, ch, within)
	time.Sleep(300 * time.Millisecond) // a commit would have been made by now
	require.Zero(t, f.committedTotal(), "an ack not settled yet is not booked")
	redelivery.Settle(first)
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 1 }, "the settled ack is not committed")
	settle(second, false) // Config.NackDelay is 0: at once
	again := receive(t, ch, within)
	require.Equal(t, second.UUID, again.UUID)
	require.Equal(t, 2, info(t, again).Count)
	settle(again, true)
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 2 }, "not committed")
}

// AckTimeout counts from the hand-out, not from the moment the record was ready: a consumer
// that is slow to take the next message does not find it expired.
func TestSubscriber_DirectSettleAckTimeoutCountsFromTheHandOut(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	f.publish(0, 1)
	ch := f.subscribeDirect(f.subscriber(kafkabroker.Config{AckTimeout: 300 * time.Millisecond}))
	time.Sleep(600 * time.Millisecond) // the record waits to be taken
	m := receive(t, ch, within)
	require.NoError(t, m.Context().Err(), "expired before it was handed out")
	select {
	case <-m.Context().Done():
		require.ErrorIs(t, context.Cause(m.Context()), kafkabroker.ErrAckTimeout)
	case <-time.After(within):
		t.Fatal("the delivery did not end after AckTimeout")
	}
	settle(m, true) // too late: ignored
	again := receive(t, ch, within)
	require.Equal(t, m.UUID, again.UUID)
	require.Equal(t, 2, info(t, again).Count)
	settle(again, true)
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 1 }, "not committed")
}

// An ack given before the subscription ends counts, though the consumer has not settled it yet.
func TestSubscriber_DirectSettleAckGivenBeforeCloseCounts(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	f.publish(0, 1)
	s := f.subscriber(kafkabroker.Config{})
	m := receive(t, f.subscribeDirect(s), within)
	m.Ack()
	require.NoError(t, s.Close())
	require.Equal(t, int64(1), f.committedTotal())
}
