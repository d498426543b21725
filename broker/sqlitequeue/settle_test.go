package sqlitequeue_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// A consumer that settles directly (redelivery.WithDirectSettle, as onceflow's router does)
// frees a message's room in the window by redelivery.Settle, not by the Ack alone: the next
// message comes once the acked one is settled, and the acknowledgement is committed.
func TestSubscriber_DirectSettleFreesTheWindowOnSettle(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 1})
	ids := publishN(t, q, "t", 2)
	ctx, cancel := context.WithCancel(redelivery.WithDirectSettle(context.Background()))
	msgs := subscribe(t, q, ctx, "t")

	first := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], first.UUID)
	require.True(t, first.Ack())
	requireNothing(t, msgs, 100*time.Millisecond) // acked, not settled: the window is full
	redelivery.Settle(first)
	second := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[1], second.UUID)
	require.Equal(t, 1, deliveryCount(t, second))
	require.True(t, second.Ack())
	redelivery.Settle(second)
	redelivery.Settle(second) // a second Settle does nothing

	cancel()
	for range msgs { // closed once the acknowledgements are committed
	}
	left, err := q.Backlog(context.Background(), "t", "g")
	require.NoError(t, err)
	require.Zero(t, left)
}

// A message nacked and settled directly comes back after its delay with its count up by one,
// and the message behind it is not held up meanwhile.
func TestSubscriber_DirectSettleNackComesBackWithCountPlusOne(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 1, ResendInterval: 50 * time.Millisecond})
	ids := publishN(t, q, "t", 2)
	msgs := subscribe(t, q, redelivery.WithDirectSettle(context.Background()), "t")

	m := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], m.UUID)
	require.True(t, m.Nack())
	redelivery.Settle(m)
	behind := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[1], behind.UUID, "the nacked message does not block the one behind it")
	require.True(t, behind.Ack())
	redelivery.Settle(behind)
	again := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], again.UUID)
	require.Equal(t, 2, deliveryCount(t, again))
	require.True(t, again.Ack())
	redelivery.Settle(again)
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(context.Background(), "t", "g") }, "backlog")
}

// A message that a directly settling consumer neither settles nor acks within the ack deadline
// has its context cancelled and is delivered again, with its count up by one; a Settle after
// that does nothing to the new delivery.
func TestSubscriber_DirectSettleUnsettledLeaseExpires(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 1, AckDeadline: 100 * time.Millisecond})
	ids := publishN(t, q, "t", 1)
	msgs := subscribe(t, q, redelivery.WithDirectSettle(context.Background()), "t")

	m := receive(t, msgs, 5*time.Second)
	require.Equal(t, 1, deliveryCount(t, m))
	select {
	case <-m.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the context of the unsettled message did not end with its lease")
	}
	again := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], again.UUID)
	require.Equal(t, 2, deliveryCount(t, again))
	require.True(t, m.Ack())
	redelivery.Settle(m) // the earlier delivery's: too late, and harmless
	require.True(t, again.Ack())
	redelivery.Settle(again)
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(context.Background(), "t", "g") }, "backlog")
}

// A consumer that settles directly costs the subscription no goroutine per message in flight;
// any other consumer gets a watcher per message.
func TestSubscriber_DirectSettleStartsNoGoroutinePerMessage(t *testing.T) { //nolint:paralleltest // counts goroutines
	const n = 64
	for _, c := range []struct {
		name   string
		ctx    context.Context
		direct bool
	}{
		{"direct", redelivery.WithDirectSettle(context.Background()), true},
		{"watching", context.Background(), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: n})
			publishN(t, q, "t", n)
			ctx, cancel := context.WithCancel(c.ctx)
			defer cancel()
			msgs := subscribe(t, q, ctx, "t")
			first := receive(t, msgs, 5*time.Second)
			before := runtime.NumGoroutine()
			held := []*message.Message{first}
			for len(held) < n {
				held = append(held, receive(t, msgs, 5*time.Second))
			}
			grown := runtime.NumGoroutine() - before
			if c.direct {
				require.Less(t, grown, 8, "goroutines started for %d messages", n-1)
			} else {
				require.GreaterOrEqual(t, grown, n-8, "goroutines started for %d messages", n-1)
			}
			for _, m := range held {
				m.Ack()
				redelivery.Settle(m)
			}
			eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(context.Background(), "t", "g") }, "backlog")
		})
	}
}

// A consumer that settles a batch together and flushes it (redelivery.Flush, as the router
// does after a group's acks) gets the room it freed claimed at once, though that is less than
// half the window, which the subscription waits for otherwise (or fillWait, here an hour).
func TestSubscriber_DirectFlushClaimsTheFreeRoomAtOnce(t *testing.T) {
	sqlitequeue.SetFillWait(t, time.Hour)
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 10})
	ids := publishN(t, q, "t", 20)
	ctx, cancel := context.WithCancel(redelivery.WithDirectSettle(context.Background()))
	msgs := subscribe(t, q, ctx, "t")

	var got []*message.Message
	for i := range 10 {
		m := receive(t, msgs, 5*time.Second)
		require.Equal(t, ids[i], m.UUID)
		got = append(got, m)
	}
	for _, m := range got[:3] {
		require.True(t, m.Ack())
		redelivery.Settle(m)
	}
	requireNothing(t, msgs, 300*time.Millisecond) // 3 places free, less than half the window
	redelivery.Flush(got[2])
	for i := 10; i < 13; i++ {
		m := receive(t, msgs, 5*time.Second)
		require.Equal(t, ids[i], m.UUID)
		got = append(got, m)
	}
	requireNothing(t, msgs, 300*time.Millisecond) // the window is full again
	for _, m := range got[3:] {
		require.True(t, m.Ack())
		redelivery.Settle(m)
	}
	cancel()
	for range msgs { // closed once the acknowledgements are committed
	}
	left, err := q.Backlog(context.Background(), "t", "g")
	require.NoError(t, err)
	require.EqualValues(t, 7, left)
}
