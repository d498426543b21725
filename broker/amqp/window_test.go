package amqp

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// frames records what a window's take would send.
type frames struct {
	prefix    uint64
	prefixLen int
	singles   []uint64
}

func take(w *window) frames {
	p, n, s := w.take(true)
	return frames{prefix: p, prefixLen: n, singles: s}
}

func deliver(w *window, tags ...uint64) {
	for _, t := range tags {
		w.add(t)
	}
}

func TestWindow_AcksInOrderGoAsOneMultipleAck(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4, 5)
	for _, tag := range []uint64{1, 2, 3} {
		w.ack(tag)
	}
	require.Equal(t, 3, w.pending())
	require.True(t, w.busy(), "4 and 5 are open")
	require.Equal(t, frames{prefix: 3, prefixLen: 3}, take(&w))
	require.Equal(t, uint64(3), w.base)
	require.Equal(t, 0, w.pending())
	require.Equal(t, frames{}, take(&w), "nothing more to send")
}

func TestWindow_AcksBehindAnOpenDeliveryGoOneByOne(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4)
	w.ack(3)
	w.ack(2)
	require.Equal(t, frames{singles: []uint64{2, 3}}, take(&w), "1 is open: a multiple ack of 3 would ack it")
	w.ack(1)
	require.Equal(t, frames{prefix: 1, prefixLen: 1}, take(&w))
	require.Equal(t, uint64(3), w.base, "2 and 3 were settled already")
	w.ack(4)
	require.False(t, w.busy())
	require.Equal(t, frames{prefix: 4, prefixLen: 1}, take(&w))
	require.Empty(t, w.states)
}

func TestWindow_APrefixRunsOverSettledTags(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4)
	w.ack(2)
	require.Equal(t, frames{singles: []uint64{2}}, take(&w))
	w.ack(1)
	w.ack(3)
	require.Equal(t, frames{prefix: 3, prefixLen: 2}, take(&w), "one ack of 3 with multiple settles 1 and 3")
	require.Equal(t, uint64(3), w.base)
}

func TestWindow_TakingThePrefixOnlyLeavesTheOthersPending(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4, 5)
	w.ack(1)
	w.ack(2)
	w.ack(4)
	p, n, singles := w.take(false)
	require.Equal(t, frames{prefix: 2, prefixLen: 2}, frames{prefix: p, prefixLen: n, singles: singles})
	require.Equal(t, 1, w.pending(), "4 waits for 3")
	w.ack(3)
	require.Equal(t, frames{prefix: 4, prefixLen: 2}, take(&w), "3 and 4 in one ack")
}

func TestWindow_AHeldNackStopsThePrefix(t *testing.T) {
	var w window
	deliver(&w, 1, 2, 3, 4, 5)
	w.ack(1)
	w.hold(2)
	w.ack(3)
	w.ack(4)
	require.Equal(t, frames{prefix: 1, prefixLen: 1, singles: []uint64{3, 4}}, take(&w))
	require.True(t, w.busy(), "5 is open")
	w.settle(2) // the nack is sent
	w.ack(5)
	require.Equal(t, frames{prefix: 5, prefixLen: 1}, take(&w))
	require.Empty(t, w.states)
}

func TestWindow_NotBusyWhenOnlyHeldAndAckedRemain(t *testing.T) {
	var w window
	deliver(&w, 1, 2)
	w.hold(1)
	require.True(t, w.busy())
	w.ack(2)
	require.False(t, w.busy())
	require.Equal(t, 1, w.pending())
}

func TestWindow_UnknownTagsAreIgnoredAndGapsAreSettled(t *testing.T) {
	var w window
	deliver(&w, 1, 4)
	require.Equal(t, gone, w.state(2))
	require.Equal(t, open, w.state(4))
	w.add(3) // below the newest: ignored
	w.ack(9) // not delivered: ignored
	w.ack(1)
	w.ack(4)
	require.Equal(t, frames{prefix: 4, prefixLen: 2}, take(&w))
	w.ack(4) // settled: ignored
	require.Equal(t, 0, w.pending())
}

// A long run of acks behind one held message: the window never sends a multiple ack over it,
// and keeps one byte per tag until it goes.
func TestWindow_ManyAcksBehindAHeldOne(t *testing.T) {
	var w window
	const n = 1000
	for tag := uint64(1); tag <= n; tag++ {
		w.add(tag)
	}
	w.hold(1)
	sent := 0
	for tag := uint64(2); tag <= n; tag++ {
		w.ack(tag)
		f := take(&w)
		require.Zero(t, f.prefix)
		sent += len(f.singles)
	}
	require.Equal(t, n-1, sent)
	require.Equal(t, []uint64{1}, w.tagsIn(held))
	w.settle(1)
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
