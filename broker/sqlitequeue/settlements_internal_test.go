package sqlitequeue

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSettlements_ATransactionTakesEveryoneSettlementsAndGivesThemBackWhenItFails(t *testing.T) {
	p := newSettlements()
	t0 := time.Now()
	_, ok := p.due()
	require.False(t, ok)
	p.add(settlement{offset: 1, ack: true}, t0)                       // one subscription's
	p.add(settlement{offset: 2, ack: true}, t0.Add(time.Millisecond)) // another's
	due, ok := p.due()
	require.True(t, ok)
	require.Equal(t, t0.Add(settleWait), due, "settleWait after the oldest")

	first := p.take()
	require.Equal(t, []int64{1, 2}, offsets(first))
	require.Zero(t, p.len())
	p.add(settlement{offset: 3, ack: true}, t0.Add(2*time.Millisecond))
	p.done(first, true) // the transaction failed: they wait again, first
	require.Equal(t, 3, p.len())

	second := p.take()
	require.Equal(t, []int64{1, 2, 3}, offsets(second))
	p.done(second, false)
	require.Zero(t, p.len())
	_, ok = p.due()
	require.False(t, ok)
}

// A closing subscription waits for its settlements that another's transaction took, also one
// that took them after it looked, and learns how many it must commit itself.
func TestSettlements_WaitReturnsOnceTheSubscriptionsOwnAreCommittedOrWaitAgain(t *testing.T) {
	p := newSettlements()
	a, b := &subscription{}, &subscription{}
	p.add(settlement{offset: 1, ack: true, from: a}, time.Now())
	require.Equal(t, 1, p.wait(a), "no transaction took it: a commits it")

	waitA := func() <-chan int {
		left := make(chan int, 1)
		go func() { left <- p.wait(a) }()
		select {
		case <-left:
			t.Fatal("wait returned while a transaction holds a's settlement")
		case <-time.After(50 * time.Millisecond):
		}
		return left
	}
	taken := p.take() // b's transaction, after a looked
	p.add(settlement{offset: 2, ack: true, from: b}, time.Now())
	left := waitA()
	p.done(taken, true)
	require.Equal(t, 1, <-left, "b's transaction failed: a's settlement waits again, for a")

	taken = p.take()
	left = waitA()
	p.done(taken, false)
	require.Zero(t, <-left)
	require.Zero(t, p.wait(b))
	require.Zero(t, p.len())
}

func offsets(list []settlement) []int64 {
	out := make([]int64, len(list))
	for i, s := range list {
		out[i] = s.offset
	}
	return out
}
