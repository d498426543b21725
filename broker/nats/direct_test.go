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
	"github.com/onceflow/onceflow/internal/testsvc"
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
		held = append(held, testsvc.Receive(t, ch, within))
	}
	ack(held[0])
	f.requireAcked(1, n-1) // before the cut

	p.Cut()
	for _, m := range held[1:] {
		testsvc.RequireCause(t, m, natsbroker.ErrConnectionLost, within)
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
		m := testsvc.Receive(t, ch, within)
		_, seen := got[m.UUID]
		require.False(t, seen, "message %s delivered twice after the reconnection", m.UUID)
		got[m.UUID] = testsvc.Info(t, m).Count
		ack(m)
	}
	require.Equal(t, want, got, "delivery counts after the reconnection")
	f.requireAcked(n+2, 0)
	testsvc.RequireOpenAndNothing(t, ch, 3*time.Second) // more than AckWait: the acks after the reconnection hold
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
		m := testsvc.Receive(t, ch, within)
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
		testsvc.RequireCause(t, m, natsbroker.ErrClosed, within)
	}
	for _, m := range held {
		redelivery.Settle(m) // after Close: nothing more happens
	}
	_, open := <-ch
	require.False(t, open, "channel closed by Close")

	next := f.subscribeDirect(f.subscriber(cfg))
	counts := map[string]int{}
	for range n - 3 {
		m := testsvc.Receive(t, next, 10*time.Second)
		counts[m.UUID] = testsvc.Info(t, m).Count
		ack(m)
	}
	require.Equal(t, map[string]int{ids[3]: 2, ids[4]: 2, ids[5]: 2}, counts, "the unsettled deliveries, given back")
	testsvc.RequireOpenAndNothing(t, next, time.Second) // the nacked one waits its minute; the acked ones are done
	// The acks given before Close make the floor; the nacked message is the one pending.
	f.requireAcked(2, 1)
}
