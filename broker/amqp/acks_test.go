package amqp_test

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
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
		single, multiple := consumeAll(t, f, n, prefetch, func(m *message.Message) { m.Ack() }, nil)
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
				m.Ack()
			})
		}, acks.Wait)
		t.Logf("%d acks out of order: %d frames (%d with multiple, %d single)", n, single+multiple, multiple, single)
		require.Less(t, single+multiple, n)
	})
}
