package amqp_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// The tests of this file subscribe as the router does (redelivery.WithDirectSettle) and call
// redelivery.Settle after each ack and nack: the subscription settles in that call, so the
// frames it sends are counted right after it, without waiting.

// directFixture returns a fixture whose subscriptions settle directly, on a classic queue.
func directFixture(t *testing.T) *fixture {
	t.Helper()
	f := setup(t, amqp.Queue{})
	f.direct = true
	return f
}

// frames returns the counts of c as single, multiple, nack.
func frames(c *amqp.FrameCounter) [3]int {
	single, multiple, nacks := c.Frames()
	return [3]int{single, multiple, nacks}
}

// slowAcks returns f's Config with prefetch whose acks wait for nothing but the window: half
// of it acked at the front, or no delivery open.
func slowAcks(f *fixture, prefetch int) amqp.Config {
	cfg := f.config(prefetch)
	cfg.AckDelay = time.Minute
	cfg.OutOfOrderAckDelay = time.Minute
	return cfg
}

func TestSubscriber_DirectSettleSendsTheAckInTheSettlingCall(t *testing.T) {
	t.Parallel()
	f := directFixture(t)
	f.publish("m", 3)
	s := f.subscriber(slowAcks(f, 3)) // half the window: 2
	var c amqp.FrameCounter
	amqp.CountFrames(s, &c)
	got := testsvc.ReceiveN(t, f.subscribe(s), 3, within)

	ack(got[0])
	require.Equal(t, [3]int{0, 0, 0}, frames(&c), "one ack waits for half the window")
	ack(got[1])
	require.Equal(t, [3]int{0, 1, 0}, frames(&c), "half the window acked: one multiple ack, sent by Settle")
	ack(got[2])
	testsvc.Eventually(t, within, func() bool { return frames(&c) == [3]int{1, 1, 0} },
		"the last ack, with no delivery open, is not sent")
	require.NoError(t, s.Close())
	require.Equal(t, [3]int{1, 1, 0}, frames(&c), "Close sends nothing more")
	f.eventuallyReady(0)
}

// A consumer that settled a batch together flushes it (redelivery.Flush): the acks go at once
// in one frame, without waiting for AckDelay or half the window.
func TestSubscriber_DirectFlushSendsTheBatchsAcksInOneFrame(t *testing.T) {
	t.Parallel()
	f := directFixture(t)
	f.publish("m", 10)
	s := f.subscriber(slowAcks(f, 10)) // half the window: 5
	var c amqp.FrameCounter
	amqp.CountFrames(s, &c)
	got := testsvc.ReceiveN(t, f.subscribe(s), 10, within)

	for _, m := range got[:3] {
		ack(m)
	}
	require.Equal(t, [3]int{0, 0, 0}, frames(&c), "three acks wait for more")
	redelivery.Flush(got[2])
	require.Equal(t, [3]int{0, 1, 0}, frames(&c), "the flush sends them as one multiple ack")
	redelivery.Flush(got[2])
	require.Equal(t, [3]int{0, 1, 0}, frames(&c), "a flush with nothing waiting sends nothing")
	ack(got[4])
	redelivery.Flush(got[4])
	require.Equal(t, [3]int{0, 1, 0}, frames(&c), "an ack behind an open delivery waits for it")
	for _, m := range got[5:] {
		ack(m)
	}
	ack(got[3])
	testsvc.Eventually(t, within, func() bool { return frames(&c) == [3]int{0, 2, 0} },
		"the rest, with no delivery open, is not sent as one multiple ack")
	require.NoError(t, s.Close())
	f.eventuallyReady(0)
}

func TestSubscriber_DirectNackRedeliversAtOnce(t *testing.T) {
	t.Parallel()
	f := directFixture(t)
	id := f.publish("m", 1)[0]
	s := f.subscriber(f.config(10)) // NackDelay 0
	var c amqp.FrameCounter
	amqp.CountFrames(s, &c)
	msgs := f.subscribe(s)
	first := receive(t, msgs)

	nack(first)
	require.Equal(t, [3]int{0, 0, 1}, frames(&c), "the nack is sent by Settle")
	again := receive(t, msgs)
	require.Equal(t, id, again.UUID)
	requireAgain(t, amqp.Classic, again)
	ack(again)
	testsvc.Eventually(t, within, func() bool { return frames(&c) == [3]int{1, 0, 1} }, "the ack is not sent")
	f.eventuallyReady(0)
}

// Acks settled in reverse order wait behind the oldest delivery, and go as one multiple ack
// when it is acked: exactly one frame for ten acks.
func TestSubscriber_DirectAcksOutOfOrderGoAsOneMultipleAck(t *testing.T) {
	t.Parallel()
	f := directFixture(t)
	const n = 10
	f.publish("m", n)
	s := f.subscriber(slowAcks(f, n))
	var c amqp.FrameCounter
	amqp.CountFrames(s, &c)
	got := testsvc.ReceiveN(t, f.subscribe(s), n, within)
	for i := n - 1; i > 0; i-- {
		ack(got[i])
	}
	require.Equal(t, [3]int{0, 0, 0}, frames(&c), "acks behind the open oldest delivery wait")
	ack(got[0])
	require.Equal(t, [3]int{0, 1, 0}, frames(&c), "ten acks, one multiple ack")
	require.NoError(t, s.Close())
	require.Equal(t, [3]int{0, 1, 0}, frames(&c))
	f.eventuallyReady(0)
}

// A lost connection ends every unsettled delivery's context; an ack settled after it, or given
// before it and not sent yet, is dropped, and RabbitMQ delivers the messages again on the new
// channel, where they are acked in three frames as any others.
func TestSubscriber_DirectAcksOfALostChannelAreDropped(t *testing.T) {
	t.Parallel()
	f := directFixture(t)
	const n = 3
	px := newProxy(t, f.url)
	cfg := slowAcks(f, n)
	cfg.URL = px.url
	cfg.ReconnectInitial = 50 * time.Millisecond
	s := f.subscriber(cfg)
	var c amqp.FrameCounter
	amqp.CountFrames(s, &c)
	ids := f.publish("m", n)
	msgs := f.subscribe(s)
	first := testsvc.ReceiveN(t, msgs, n, within)
	ack(first[0]) // waits for half the window: not sent when the connection goes

	px.cut()
	for _, m := range first[1:] {
		select {
		case <-m.Context().Done():
		case <-time.After(within):
			t.Fatalf("message %s: context not cancelled when the connection was lost", m.UUID)
		}
	}
	ack(first[1])
	ack(first[2])
	require.Equal(t, [3]int{0, 0, 0}, frames(&c), "nothing is sent for a lost channel")
	px.restore(t)

	again := testsvc.ReceiveN(t, msgs, n, within)
	require.Equal(t, ids, uuids(again))
	for _, m := range again {
		requireAgain(t, amqp.Classic, m)
		ack(m)
	}
	testsvc.Eventually(t, within, func() bool { return frames(&c) == [3]int{1, 1, 0} },
		"the acks on the new channel are not sent")
	require.NoError(t, s.Close())
	require.Equal(t, [3]int{1, 1, 0}, frames(&c))
	f.eventuallyReady(0)
}

// Close sends the acks settled before it, and an ack given before it whose Settle comes
// after; it gives the others back. A Settle after Close sends nothing.
func TestSubscriber_DirectCloseSendsEveryAckGiven(t *testing.T) {
	t.Parallel()
	f := directFixture(t)
	const n = 10
	ids := f.publish("m", n)
	s := f.subscriber(slowAcks(f, n)) // half the window: 5
	var c amqp.FrameCounter
	amqp.CountFrames(s, &c)
	got := testsvc.ReceiveN(t, f.subscribe(s), n, within)
	ack(got[0])
	ack(got[1])
	got[3].Ack() // its Settle comes after Close
	require.Equal(t, [3]int{0, 0, 0}, frames(&c))

	require.NoError(t, s.Close())
	require.Equal(t, [3]int{1, 1, 0}, frames(&c), "m-0 and m-1 in one multiple ack, m-3 alone")
	redelivery.Settle(got[3])
	ack(got[4])
	require.Equal(t, [3]int{1, 1, 0}, frames(&c), "a Settle after Close sends nothing")
	for _, m := range got {
		require.Error(t, m.Context().Err(), "message %s: context not cancelled by Close", m.UUID)
	}

	f.eventuallyReady(n - 3)
	again := testsvc.ReceiveN(t, f.subscribe(f.subscriber(f.config(n))), n-3, within)
	want := append([]string{ids[2]}, ids[4:]...)
	require.ElementsMatch(t, want, uuids(again))
	for _, m := range again {
		ack(m)
	}
	f.eventuallyReady(0)
}
