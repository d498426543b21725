package redis_test

import (
	"context"
	"log/slog"
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

func TestDirectSettle_AcksFreeTheirPlacesWhenSettledAndGoInFewXACKs(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 200
	msgs := f.publish(n + 1)
	c := f.client(f.url)
	hook := &countingHook{}
	c.AddHook(hook)
	sub, err := redissub.NewSubscriber(c, redissub.Config{ConsumerGroup: group, Prefetch: n})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ch := f.subscribeDirect(sub)

	got := receiveN(t, ch, n, 10*time.Second)
	for i, m := range got {
		require.Equal(t, msgs[i].UUID, m.UUID)
		m.Ack()
	}
	// The subscriber does not watch the messages: the acks alone free no place, and are
	// not sent.
	requireNothing(t, ch, 300*time.Millisecond)
	require.EqualValues(t, n, f.pendingCount())
	for _, m := range got {
		redelivery.Settle(m)
		require.Error(t, m.Context().Err(), "the context ends when the delivery is settled")
		redelivery.Settle(m) // once settled, Settle does nothing
	}
	last := receive(t, ch, 10*time.Second)
	require.Equal(t, msgs[n].UUID, last.UUID)
	ack(last)
	f.requirePending(0)
	hook.mu.Lock()
	defer hook.mu.Unlock()
	require.Equal(t, n+1, hook.ids, "each ack is sent once")
	require.LessOrEqual(t, hook.commands, 6, "%d acks settled together took %d XACKs", n+1, hook.commands)
}

func TestDirectSettle_NackAfterComesBackAfterTheDelayCountedAndHoldsNothingBack(t *testing.T) {
	t.Parallel()
	f := setup(t)
	msgs := f.publish(3)
	ch := f.subscribeDirect(f.subscriber(f.url, redissub.Config{Prefetch: 1, AckTimeout: 10 * time.Second, NackDelay: time.Minute}))

	m := receive(t, ch, 10*time.Second)
	require.Equal(t, msgs[0].UUID, m.UUID)
	const delay = 700 * time.Millisecond
	nacked := time.Now()
	require.True(t, redelivery.NackAfter(m, delay))
	redelivery.Settle(m)
	requireDone(t, m.Context(), 5*time.Second, "a nacked delivery")

	// The place is free at once: the entries behind come while the nacked one waits.
	for _, want := range msgs[1:] {
		other := receive(t, ch, 10*time.Second)
		require.Equal(t, want.UUID, other.UUID)
		ack(other)
	}
	again := receive(t, ch, 10*time.Second)
	require.Equal(t, msgs[0].UUID, again.UUID)
	require.GreaterOrEqual(t, time.Since(nacked), delay, "the delay the nack asked for, not NackDelay")
	require.Equal(t, 2, info(t, again).Count)

	// A plain Nack waits for NackDelay: a minute, longer than the test looks.
	again.Nack()
	redelivery.Settle(again)
	requireNothing(t, ch, time.Second)
	f.requirePending(1)
}

func TestDirectSettle_DeliveriesWhoseAckTimeoutPassesEndAndComeBackOnce(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 5
	msgs := f.publish(n)
	ch := f.subscribeDirect(f.subscriber(f.url, redissub.Config{Prefetch: n, AckTimeout: 500 * time.Millisecond}))

	held := receiveN(t, ch, n, 10*time.Second)
	// Settled in the middle of the hand and at its end; the others pass their ack timeout.
	ack(held[1])
	ack(held[4])
	for _, i := range []int{0, 2, 3} {
		requireDone(t, held[i].Context(), 5*time.Second, "a delivery past its ack timeout")
	}
	counts := map[string]int{}
	for range 3 {
		m := receive(t, ch, 10*time.Second) // claimed again, by the same consumer
		_, seen := counts[m.UUID]
		require.False(t, seen, "%s delivered twice", m.UUID)
		counts[m.UUID] = info(t, m).Count
		ack(m)
	}
	require.Equal(t, map[string]int{msgs[0].UUID: 2, msgs[2].UUID: 2, msgs[3].UUID: 2}, counts)
	f.requirePending(0)
	requireNothing(t, ch, time.Second) // more than the ack timeout: every ack held
}

func TestDirectSettle_AWindowPlaceComesBackOncePerDelivery(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.publish(2)
	ch := f.subscribeDirect(f.subscriber(f.url, redissub.Config{Prefetch: 1, AckTimeout: 500 * time.Millisecond}))

	x := receive(t, ch, 10*time.Second)
	requireDone(t, x.Context(), 5*time.Second, "a delivery past its ack timeout")
	y := receive(t, ch, 10*time.Second) // the place x held
	// x's late settlement is dropped: it frees no place, y holds the only one.
	ack(x)
	requireNothing(t, ch, 200*time.Millisecond)
	ack(y)
	z := receive(t, ch, 10*time.Second)
	ack(z)
	f.requirePending(0)
}

func TestDirectSettle_LostConnectionEndsTheDeliveriesInFlightAndGivesThemBack(t *testing.T) {
	t.Parallel()
	f := setup(t)
	px := f.proxy()
	const n = 5
	msgs := f.publish(n)
	ch := f.subscribeDirect(f.subscriber(px.url, redissub.Config{}))
	held := receiveN(t, ch, n, 10*time.Second)
	ack(held[0])
	f.requirePending(n - 1) // before the cut

	px.cut()
	for _, m := range held[1:] {
		requireDone(t, m.Context(), 5*time.Second, "a delivery in flight at a lost connection")
		ack(m) // the delivery has ended: dropped
	}
	px.restore(t)

	// Given back on reconnection, not after the 30 s ack timeout.
	got := map[string]int{}
	for range n - 1 {
		m := receive(t, ch, 10*time.Second)
		_, seen := got[m.UUID]
		require.False(t, seen, "%s delivered twice after the reconnection", m.UUID)
		got[m.UUID] = info(t, m).Count
		ack(m)
	}
	want := map[string]int{}
	for _, m := range msgs[1:] {
		want[m.UUID] = 2
	}
	require.Equal(t, want, got, "delivery counts after the reconnection")
	f.requirePending(0)
	requireNothing(t, ch, 300*time.Millisecond)
}

func TestDirectSettle_CloseSendsTheAcksAndNacksGivenAndGivesTheRestBack(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 6
	msgs := f.publish(n)
	sub := f.subscriber(f.url, redissub.Config{AckTimeout: time.Minute})
	ch := f.subscribeDirect(sub)
	held := receiveN(t, ch, n, 10*time.Second)
	ack(held[0])
	// Acked and nacked, but Close comes before the consumer settles them: what they say
	// still counts.
	held[1].Ack()
	require.True(t, redelivery.NackAfter(held[2], time.Minute))
	// held[3:] are not settled: Close gives them back.

	require.NoError(t, sub.Close())
	for _, m := range held {
		requireDone(t, m.Context(), time.Second, "a delivery of a closed subscriber")
		redelivery.Settle(m) // after Close: nothing more happens
	}
	_, open := <-ch
	require.False(t, open, "channel closed by Close")
	require.EqualValues(t, 4, f.pendingCount(), "the nacked entry and the three given back")

	ch = f.subscribeDirect(f.subscriber(f.url, redissub.Config{AckTimeout: time.Minute}))
	got := map[string]int{}
	for range n - 3 {
		m := receive(t, ch, 10*time.Second)
		got[m.UUID] = info(t, m).Count
		ack(m)
	}
	require.Equal(t, map[string]int{msgs[3].UUID: 2, msgs[4].UUID: 2, msgs[5].UUID: 2}, got, "the unsettled deliveries, given back")
	requireNothing(t, ch, time.Second) // the nacked one waits its minute; the acked ones are done
	f.requirePending(1)
}

// A consumer that settles a batch together and flushes it (redelivery.Flush, as the router
// does after a group's acks) gets the room it freed read at once, though that is less than half
// the window, which the subscription waits for otherwise (or fillWait, here an hour).
func TestDirectSettle_FlushReadsTheFreeRoomAtOnce(t *testing.T) {
	redissub.SetFillWait(t, time.Hour)
	f := setup(t)
	msgs := f.publish(20)
	// The subscription's logs go to the test's output: a lost connection, say, shows there.
	logger := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	sub, err := redissub.NewSubscriber(f.client(f.url), redissub.Config{ConsumerGroup: group, Prefetch: 10, Logger: logger})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ch := f.subscribeDirect(sub)

	got := f.receiveN(ch, 10, 10*time.Second)
	for _, m := range got[:3] {
		ack(m)
	}
	requireNothing(t, ch, 300*time.Millisecond) // 3 places free, less than half the window
	redelivery.Flush(got[2])
	more := f.receiveN(ch, 3, 10*time.Second)
	for i, m := range more {
		require.Equal(t, msgs[10+i].UUID, m.UUID)
	}
	requireNothing(t, ch, 300*time.Millisecond) // the window is full again
	for _, m := range append(got[3:], more...) {
		ack(m) // 10 places free: the rest come
	}
	for i, m := range f.receiveN(ch, 7, 10*time.Second) {
		require.Equal(t, msgs[13+i].UUID, m.UUID)
		ack(m)
	}
	f.requirePending(0)
}
