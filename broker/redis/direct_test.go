package redis_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// The tests of this file consume as onceflow's router does: they subscribe with
// redelivery.WithDirectSettle and call redelivery.Settle right after each ack or nack, in the
// goroutine that gave it.

// subscribeDirect subscribes sub to the fixture's stream as a consumer that settles each
// message itself.
func (f *fixture) subscribeDirect(sub *redissub.Subscriber) <-chan *message.Message {
	f.t.Helper()
	ch, err := sub.Subscribe(redelivery.WithDirectSettle(context.Background()), f.topic)
	require.NoError(f.t, err)
	return ch
}

// ack acks m and settles it, as the router does.
func ack(m *message.Message) {
	m.Ack()
	redelivery.Settle(m)
}

// requirePending waits until n entries of the stream are pending for the group.
func (f *fixture) requirePending(n int64) {
	f.t.Helper()
	testsvc.Eventually(f.t, 10*time.Second, func() bool { return f.pendingCount() == n }, "want %d entries pending", n)
}

func TestDirectSettle_CloseSendsTheAcksAndNacksGivenAndGivesTheRestBack(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 6
	msgs := f.publish(n)
	sub := f.subscriber(f.url, redissub.Config{AckTimeout: time.Minute})
	ch := f.subscribeDirect(sub)
	held := testsvc.ReceiveN(t, ch, n, 10*time.Second)
	ack(held[0])
	// Acked and nacked, but Close comes before the consumer settles them: what they say
	// still counts.
	held[1].Ack()
	require.True(t, redelivery.NackAfter(held[2], time.Minute))
	// held[3:] are not settled: Close gives them back.

	require.NoError(t, sub.Close())
	for _, m := range held {
		testsvc.RequireDone(t, m.Context(), time.Second, "a delivery of a closed subscriber")
		redelivery.Settle(m) // after Close: nothing more happens
	}
	_, open := <-ch
	require.False(t, open, "channel closed by Close")
	require.EqualValues(t, 4, f.pendingCount(), "the nacked entry and the three given back")

	ch = f.subscribeDirect(f.subscriber(f.url, redissub.Config{AckTimeout: time.Minute}))
	got := map[string]int{}
	for range n - 3 {
		m := testsvc.Receive(t, ch, 10*time.Second)
		got[m.UUID] = testsvc.Info(t, m).Count
		ack(m)
	}
	require.Equal(t, map[string]int{msgs[3].UUID: 2, msgs[4].UUID: 2, msgs[5].UUID: 2}, got, "the unsettled deliveries, given back")
	testsvc.RequireNothing(t, ch, time.Second) // the nacked one waits its minute; the acked ones are done
	f.requirePending(1)
}
