package amqp_test

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// consumeAll publishes n messages, acks each with ack(m) from a fresh subscription with
// prefetch, closes it, and returns the frames the acks took. With n above prefetch, the
// messages all arrive only if the acks are sent without Close's help: the window never stalls.
// Before Close it waits for wait, when not nil.
func consumeAll(t *testing.T, f *fixture, n, prefetch int, ack func(m *message.Message), wait func()) (single, multiple int) {
	t.Helper()
	f.publish("m", n)
	s := f.subscriber(f.config(prefetch))
	var frames amqp.FrameCounter
	amqp.CountFrames(s, &frames)
	msgs := f.subscribe(s)
	for range n {
		ack(receive(t, msgs))
	}
	if wait != nil {
		wait()
	}
	require.NoError(t, s.Close())
	f.eventuallyReady(0) // every message acked: none given back
	single, multiple, nacks := frames.Frames()
	require.Zero(t, nacks)
	return single, multiple
}

func TestSubscriber_AcksInArrivalOrderAreCoalesced(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const n, prefetch = 2000, 100
		single, multiple := consumeAll(t, f, n, prefetch, func(m *message.Message) { ack(m) }, nil)
		t.Logf("%d acks in arrival order: %d frames (%d with multiple, %d single)", n, single+multiple, multiple, single)
		require.Less(t, single+multiple, n/2, "at most one frame for two acks")
	})
}

func TestSubscriber_AcksOutOfOrderAreCoalescedWherePossible(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const n, prefetch = 2000, 100
		var acks sync.WaitGroup
		single, multiple := consumeAll(t, f, n, prefetch, func(m *message.Message) {
			// Processed concurrently, as the router does: they finish in any order.
			acks.Go(func() {
				time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
				ack(m)
			})
		}, acks.Wait)
		t.Logf("%d acks out of order: %d frames (%d with multiple, %d single)", n, single+multiple, multiple, single)
		require.Less(t, single+multiple, n/4, "acks behind older deliveries wait for them")
	})
}

// Acks given out of order while older deliveries are still being processed wait for them, and
// go as multiple acks: one or two frames for ten acks.
func TestSubscriber_AcksOutOfOrderGoAsOneMultipleAck(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const n = 10
		f.publish("m", n)
		cfg := f.config(n)
		cfg.AckDelay = time.Minute // only the acks themselves send anything
		cfg.OutOfOrderAckDelay = time.Minute
		s := f.subscriber(cfg)
		var frames amqp.FrameCounter
		amqp.CountFrames(s, &frames)
		got := testsvc.ReceiveN(t, f.subscribe(s), n, within)
		for i := n - 1; i >= 0; i-- {
			ack(got[i])
		}
		// The acks reach the session in any order (each from its delivery's goroutine, unless
		// the consumer settles directly): the ones that make the front of the window contiguous
		// go as a multiple ack, and once half the window waits behind an acked front it goes
		// early. Ten acks take one or two multiple acks, never ten frames.
		testsvc.Eventually(t, within, func() bool {
			_, multiple, _ := frames.Frames()
			return multiple >= 1
		}, "no multiple ack is sent")
		require.NoError(t, s.Close()) // sends every ack given, if any still waits
		single, multiple, nacks := frames.Frames()
		require.LessOrEqual(t, single+multiple, 2, "ten acks in one or two frames (%d single, %d multiple)", single, multiple)
		require.Zero(t, nacks)
		f.eventuallyReady(0) // none was given back: every one was acked
	})
}

// An ack behind a delivery that is not acked in time goes alone: the window never waits for a
// stuck delivery longer than its bound, and the stuck one is not acked with it.
func TestSubscriber_AnAckBehindAStuckDeliveryGoesAlone(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const n = 4
		ids := f.publish("m", n)
		cfg := f.config(n)
		cfg.AckDelay = time.Millisecond
		cfg.OutOfOrderAckDelay = 20 * time.Millisecond
		s := f.subscriber(cfg)
		var frames amqp.FrameCounter
		amqp.CountFrames(s, &frames)
		msgs := f.subscribe(s)
		got := testsvc.ReceiveN(t, msgs, n, within)
		ack(got[1])
		ack(got[2])
		testsvc.Eventually(t, within, func() bool {
			single, _, _ := frames.Frames()
			return single == 2
		}, "the acks behind m-0 are not sent")
		single, multiple, nacks := frames.Frames()
		require.Equal(t, [3]int{2, 0, 0}, [3]int{single, multiple, nacks}, "single, multiple, nack frames")
		require.NoError(t, s.Close())
		single, multiple, nacks = frames.Frames()
		require.Equal(t, [3]int{2, 0, 0}, [3]int{single, multiple, nacks}, "Close sends nothing more")
		f.eventuallyReady(2)
		again := testsvc.ReceiveN(t, f.subscribe(f.subscriber(f.config(n))), 2, within)
		require.ElementsMatch(t, []string{ids[0], ids[3]}, uuids(again))
	})
}
