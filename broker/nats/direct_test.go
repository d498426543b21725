package nats_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/broker/redelivery"
)

// The tests of this file consume as onceflow's router does: they subscribe with
// redelivery.WithDirectSettle and call redelivery.Settle right after each ack or nack, in the
// goroutine that gave it.

// subscribeDirect subscribes s to the fixture's topic as a consumer that settles each message
// itself, until the test ends.
func (f *fixture) subscribeDirect(s *natsbroker.Subscriber) <-chan *message.Message {
	f.t.Helper()
	ch, err := s.Subscribe(redelivery.WithDirectSettle(context.Background()), f.topic)
	require.NoError(f.t, err)
	return ch
}

// ack acks m and settles it, as the router does.
func ack(m *message.Message) {
	m.Ack()
	redelivery.Settle(m)
}

// requireAcked waits until the group's consumer has every message up to the stream sequence
// floor acknowledged, and pending messages delivered and not acknowledged.
func (f *fixture) requireAcked(floor uint64, pending int) {
	f.t.Helper()
	var info *jetstream.ConsumerInfo
	require.Eventually(f.t, func() bool {
		info = f.consumerInfo()
		return info.AckFloor.Stream == floor && info.NumAckPending == pending
	}, within, 20*time.Millisecond, "want ack floor %d and %d pending", floor, pending)
}

func TestDirectSettle_AnAckFreesItsPlaceOnlyWhenSettled(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 20
	ids := f.publish(0, n)
	ch := f.subscribeDirect(f.subscriber(natsbroker.Config{Prefetch: 1}))

	first := receive(t, ch, within)
	require.Equal(t, ids[0], first.UUID)
	first.Ack()
	// The subscriber does not watch the message: the ack alone does not free the place.
	requireNothing(t, ch, 300*time.Millisecond)
	redelivery.Settle(first)
	requireCause(t, first, context.Canceled, within)
	redelivery.Settle(first) // once settled, Settle does nothing

	for i := 1; i < n; i++ {
		m := receive(t, ch, within)
		require.Equal(t, ids[i], m.UUID, "in order, each once")
		require.Equal(t, 1, info(t, m).Count)
		ack(m)
		require.Error(t, m.Context().Err(), "the context ends when the delivery is settled")
	}
	f.requireAcked(n, 0)
	require.Equal(t, uint64(n), f.consumerInfo().Delivered.Consumer, "no delivery more than the messages")
}

func TestDirectSettle_NackAfterComesBackAfterTheDelayCountedAndHoldsNothingBack(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.publish(0, 3)
	ch := f.subscribeDirect(f.subscriber(natsbroker.Config{Prefetch: 1, NackDelay: time.Minute}))

	m := receive(t, ch, within)
	require.Equal(t, ids[0], m.UUID)
	const delay = 700 * time.Millisecond
	nacked := time.Now()
	require.True(t, redelivery.NackAfter(m, delay))
	redelivery.Settle(m)
	requireCause(t, m, context.Canceled, within)

	// The place is free at once: the messages behind come while the nacked one waits.
	for _, id := range ids[1:] {
		other := receive(t, ch, within)
		require.Equal(t, id, other.UUID)
		ack(other)
	}
	again := receive(t, ch, within)
	require.Equal(t, ids[0], again.UUID)
	require.GreaterOrEqual(t, time.Since(nacked), delay, "the delay the nack asked for, not NackDelay")
	require.Equal(t, 2, info(t, again).Count)

	// A plain Nack waits for NackDelay: a minute, longer than the test looks.
	again.Nack()
	redelivery.Settle(again)
	requireNothing(t, ch, time.Second)
	require.Equal(t, 1, f.consumerInfo().NumAckPending, "the nacked message only")
}

func TestDirectSettle_DeliveriesWhoseAckWaitPassesEndAndComeBackOnce(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 5
	ids := f.publish(0, n)
	// AckWait leaves the redeliveries time to be handed out and acked before the server's
	// AckWait of their own passes, on a machine busy with the package's other tests.
	const ackWait = 2 * time.Second
	ch := f.subscribeDirect(f.subscriber(natsbroker.Config{Prefetch: n, AckWait: ackWait}))

	var held []*message.Message
	for i := range n {
		m := receive(t, ch, within)
		require.Equal(t, ids[i], m.UUID)
		held = append(held, m)
	}
	// Settled in the middle of the hand and at its end; the others pass their AckWait.
	ack(held[1])
	ack(held[4])
	for _, i := range []int{0, 2, 3} {
		requireCause(t, held[i], natsbroker.ErrAckWaitPassed, 3*ackWait)
	}
	require.ErrorIs(t, context.Cause(held[1].Context()), context.Canceled, "settled, not expired")

	counts := map[string]int{}
	for range 3 {
		m := receive(t, ch, within)
		_, seen := counts[m.UUID]
		require.False(t, seen, "%s delivered twice", m.UUID)
		counts[m.UUID] = info(t, m).Count
		ack(m)
	}
	require.Equal(t, map[string]int{ids[0]: 2, ids[2]: 2, ids[3]: 2}, counts)
	f.requireAcked(n, 0)
	requireNothing(t, ch, ackWait+500*time.Millisecond) // more than AckWait: every ack held
}

func TestDirectSettle_AWindowPlaceComesBackOncePerDelivery(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.publish(0, 2)
	ch := f.subscribeDirect(f.subscriber(natsbroker.Config{Prefetch: 1, AckWait: time.Second}))

	x := receive(t, ch, within)
	require.Equal(t, ids[0], x.UUID)
	requireCause(t, x, natsbroker.ErrAckWaitPassed, 5*time.Second)
	y := receive(t, ch, within) // the place x held
	// x's late settlement is ignored: it frees no place, y holds the only one.
	ack(x)
	requireNothing(t, ch, 300*time.Millisecond)
	ack(y)
	z := receive(t, ch, within)
	ack(z)
	require.ElementsMatch(t, ids, []string{y.UUID, z.UUID})
	f.requireAcked(2, 0)
	requireNothing(t, ch, 1500*time.Millisecond) // more than AckWait: both acks held
}

func TestDirectSettle_LostConnectionEndsTheUnsettledDeliveriesAndLeavesThemToTheServer(t *testing.T) {
	t.Parallel()
	f := setup(t)
	p, through := proxy(t, f.url)
	const n = 5
	first := f.publish(0, n)
	ch := f.subscribeDirect(f.subscriber(natsbroker.Config{
		URL:            through,
		Prefetch:       n,
		AckWait:        2 * time.Second,
		ConnectOptions: []nats.Option{nats.ReconnectWait(50 * time.Millisecond), nats.ReconnectJitter(0, 0)},
	}))
	var held []*message.Message
	for range n {
		held = append(held, receive(t, ch, within))
	}
	ack(held[0])
	f.requireAcked(1, n-1) // before the cut

	p.Stop()
	for _, m := range held[1:] {
		requireCause(t, m, natsbroker.ErrConnectionLost, within)
		ack(m) // the delivery has ended: ignored
	}
	// The ack freed a place, so a pull request may have waited at the server when the
	// connection went: the server keeps it until it expires, and would give it (nobody
	// listens) the next message until AckWait. Reconnect once it is gone.
	require.Eventually(t, func() bool { return f.consumerInfo().NumWaiting == 0 }, within, 20*time.Millisecond)
	restart(t, p)

	// The server delivers the four lost deliveries again after AckWait, and the new messages.
	second := f.publish(n, n+2)
	want := map[string]int{second[0]: 1, second[1]: 1}
	for _, id := range first[1:] {
		want[id] = 2
	}
	got := map[string]int{}
	for range len(want) {
		m := receive(t, ch, within)
		_, seen := got[m.UUID]
		require.False(t, seen, "message %s delivered twice after the reconnection", m.UUID)
		got[m.UUID] = info(t, m).Count
		ack(m)
	}
	require.Equal(t, want, got, "delivery counts after the reconnection")
	f.requireAcked(n+2, 0)
	requireNothing(t, ch, 3*time.Second) // more than AckWait: the acks after the reconnection hold
}

func TestDirectSettle_CloseSendsTheAcksAndNacksGivenAndGivesTheRestBack(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const n = 6
	ids := f.publish(0, n)
	cfg := natsbroker.Config{Prefetch: n, AckWait: time.Minute}
	s := f.subscriber(cfg)
	ch := f.subscribeDirect(s)
	var held []*message.Message
	for i := range n {
		m := receive(t, ch, within)
		require.Equal(t, ids[i], m.UUID)
		held = append(held, m)
	}
	ack(held[0])
	// Acked and nacked, but Close comes before the consumer settles them: what they say
	// still reaches the server.
	held[1].Ack()
	require.True(t, redelivery.NackAfter(held[2], time.Minute))
	// held[3:] are not settled: Close gives them back.

	require.NoError(t, s.Close())
	for _, m := range held[1:] {
		requireCause(t, m, natsbroker.ErrClosed, within)
	}
	for _, m := range held {
		redelivery.Settle(m) // after Close: nothing more happens
	}
	_, open := <-ch
	require.False(t, open, "channel closed by Close")

	next := f.subscribeDirect(f.subscriber(cfg))
	counts := map[string]int{}
	for range n - 3 {
		m := receive(t, next, 10*time.Second)
		counts[m.UUID] = info(t, m).Count
		ack(m)
	}
	require.Equal(t, map[string]int{ids[3]: 2, ids[4]: 2, ids[5]: 2}, counts, "the unsettled deliveries, given back")
	requireNothing(t, next, time.Second) // the nacked one waits its minute; the acked ones are done
	// The acks given before Close make the floor; the nacked message is the one pending.
	f.requireAcked(2, 1)
}

func TestDirectSettle_SubscriptionEndsWithItsContextAndGivesBack(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.publish(0, 3)
	s := f.subscriber(natsbroker.Config{Prefetch: 3, AckWait: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := s.Subscribe(redelivery.WithDirectSettle(ctx), f.topic)
	require.NoError(t, err)
	a := receive(t, ch, within)
	b := receive(t, ch, within)
	require.Equal(t, ids[:2], []string{a.UUID, b.UUID})
	ack(a)
	cancel()
	requireCause(t, b, context.Canceled, within)
	for range ch { // the channel closes; what is not taken is given back
	}

	next := f.subscribeDirect(s)
	counts := map[string]int{}
	for range 2 {
		m := receive(t, next, 10*time.Second)
		counts[m.UUID] = info(t, m).Count
		ack(m)
	}
	require.Equal(t, map[string]int{ids[1]: 2, ids[2]: 2}, counts, "given back once each")
	ack(b) // given back: its settlement now is ignored
	f.requireAcked(3, 0)
	requireNothing(t, next, 300*time.Millisecond)
}

// A consumer that settles a batch together and flushes it (redelivery.Flush, as the router
// does after a group's acks) gets the room it freed asked for at once, though that is less than
// half the window, which the subscription waits for otherwise (or fillWait, here an hour).
func TestDirectSettle_FlushAsksForTheFreeRoomAtOnce(t *testing.T) {
	natsbroker.SetFillWait(t, time.Hour)
	f := setup(t)
	ids := f.publish(0, 20)
	ch := f.subscribeDirect(f.subscriber(natsbroker.Config{Prefetch: 10}))
	var got []*message.Message
	for i := range 10 {
		m := receive(t, ch, within)
		require.Equal(t, ids[i], m.UUID)
		got = append(got, m)
	}
	for _, m := range got[:3] {
		ack(m)
	}
	requireNothing(t, ch, 300*time.Millisecond) // 3 places free, less than half the window
	redelivery.Flush(got[2])
	for i := 10; i < 13; i++ {
		m := receive(t, ch, within)
		require.Equal(t, ids[i], m.UUID)
		got = append(got, m)
	}
	requireNothing(t, ch, 300*time.Millisecond) // the window is full again
	for _, m := range got[3:] {
		ack(m) // 10 places free: the rest come
	}
	for i := 13; i < 20; i++ {
		m := receive(t, ch, within)
		require.Equal(t, ids[i], m.UUID)
		ack(m)
	}
	f.requireAcked(20, 0)
}
