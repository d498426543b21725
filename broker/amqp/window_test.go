package amqp

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func deliver(w *window, tags ...uint64) {
	for _, t := range tags {
		w.add(t)
	}
}

func mark(w *window, s tagState, tags ...uint64) {
	for _, t := range tags {
		w.set(t, s)
	}
}

func TestWindow_AcksInOrderGoAsOneMultipleAck(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4, 5)
	mark(&w, acked, 1, 2, 3)
	require.Equal(t, 3, w.nAcked)
	require.Equal(t, 2, w.nOpen, "4 and 5 are open")
	require.Equal(t, []ackFrame{multi(3)}, w.take(true))
	require.Equal(t, uint64(3), w.base)
	require.Equal(t, 0, w.nAcked)
	require.Empty(t, w.take(true), "nothing more to send")
}

func TestWindow_AcksBehindAnOpenDeliveryGoOneByOne(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4)
	mark(&w, acked, 3, 2)
	require.Equal(t, []ackFrame{single(2), single(3)}, w.take(true), "1 is open: a multiple ack of 3 would ack it")
	mark(&w, acked, 1)
	require.Equal(t, []ackFrame{single(1)}, w.take(true))
	require.Equal(t, uint64(3), w.base, "2 and 3 were settled already")
	mark(&w, acked, 4)
	require.Zero(t, w.nOpen)
	require.Equal(t, []ackFrame{single(4)}, w.take(true))
	require.Empty(t, w.states)
}

func TestWindow_APrefixRunsOverSettledTags(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4)
	mark(&w, acked, 2)
	require.Equal(t, []ackFrame{single(2)}, w.take(true))
	mark(&w, acked, 1, 3)
	require.Equal(t, []ackFrame{multi(3)}, w.take(true), "one ack of 3 with multiple settles 1 and 3")
	require.Equal(t, uint64(3), w.base)
}

func TestWindow_TakingThePrefixOnlyLeavesTheOthersPending(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4, 5)
	mark(&w, acked, 1, 2, 4)
	require.Equal(t, []ackFrame{multi(2)}, w.take(false))
	require.Equal(t, 1, w.nAcked, "4 waits for 3")
	mark(&w, acked, 3)
	require.Equal(t, []ackFrame{multi(4)}, w.take(true), "3 and 4 in one ack")
}

func TestWindow_AHeldNackStopsThePrefix(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4, 5)
	mark(&w, acked, 1)
	mark(&w, held, 2)
	mark(&w, acked, 3, 4)
	require.Equal(t, []ackFrame{single(1), single(3), single(4)}, w.take(true))
	require.Equal(t, 1, w.nOpen, "5 is open")
	mark(&w, gone, 2) // the nack is sent
	mark(&w, acked, 5)
	require.Equal(t, []ackFrame{single(5)}, w.take(true))
	require.Empty(t, w.states)
}

func TestWindow_NotBusyWhenOnlyHeldAndAckedRemain(t *testing.T) {
	var w window
	deliver(&w, 1, 2)
	mark(&w, held, 1)
	require.Equal(t, 1, w.nOpen)
	mark(&w, acked, 2)
	require.Zero(t, w.nOpen)
	require.Equal(t, 1, w.nAcked)
}

func TestWindow_UnknownTagsAreIgnoredAndGapsAreSettled(t *testing.T) {
	var w window
	deliver(&w, 1, 4)
	require.Equal(t, gone, w.state(2))
	require.Equal(t, open, w.state(4))
	w.add(3)           // below the newest: ignored
	mark(&w, acked, 9) // not delivered: ignored
	mark(&w, acked, 1, 4)
	require.Equal(t, []ackFrame{multi(4)}, w.take(true))
	mark(&w, acked, 4) // settled: ignored
	require.Equal(t, 0, w.nAcked)
}

// A long run of acks behind one held message: the window never sends a multiple ack over it,
// and keeps one byte per tag until it goes.
func TestWindow_ManyAcksBehindAHeldOne(t *testing.T) {
	var w window
	const n = 1000
	for tag := uint64(1); tag <= n; tag++ {
		w.add(tag)
	}
	mark(&w, held, 1)
	sent := 0
	for tag := uint64(2); tag <= n; tag++ {
		mark(&w, acked, tag)
		f := w.take(true)
		require.Equal(t, []ackFrame{single(tag)}, f)
		sent += len(f)
	}
	require.Equal(t, n-1, sent)
	require.Equal(t, []uint64{1}, w.tagsIn(held))
	mark(&w, gone, 1)
	require.Empty(t, w.states)
	require.Equal(t, uint64(n), w.base)
}

// tagsIn returns the tags in state s, oldest first.
func (w *window) tagsIn(s tagState) []uint64 {
	var out []uint64
	for j, st := range w.states {
		if st == s {
			out = append(out, w.base+uint64(j)+1)
		}
	}
	return out
}
