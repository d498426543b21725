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

func TestSettlements_WaitReturnsOnceNoTransactionHoldsAny(t *testing.T) {
	p := newSettlements()
	p.add(settlement{offset: 1, ack: true}, time.Now())
	taken := p.take()
	waited := make(chan struct{})
	go func() {
		p.wait()
		close(waited)
	}()
	select {
	case <-waited:
		t.Fatal("wait returned while a transaction holds settlements")
	case <-time.After(50 * time.Millisecond):
	}
	p.done(taken, true)
	<-waited
	require.Equal(t, 1, p.len(), "not committed: it waits for the closing subscription")
}

func offsets(list []settlement) []int64 {
	out := make([]int64, len(list))
	for i, s := range list {
		out[i] = s.offset
	}
	return out
}
