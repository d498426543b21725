package inflight_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

var (
	errClosed  = errors.New("test: closed")
	errExpired = errors.New("test: deadline passed")
	errLost    = errors.New("test: connection lost")
)

// settled is one call of Source.Settle.
type settled struct {
	n int
	o inflight.Outcome
}

// source is a broker in memory for the engine: Fetch takes up to n of the messages put in
// ready (waiting for the first one), and every call the engine makes is recorded.
type source struct {
	sub      *inflight.Subscription[int]
	ready    chan int
	deadline time.Duration // each delivery's deadline from its emission; 0 for none
	fetchErr error

	settles chan settled
	closed  chan struct{}

	mu      sync.Mutex
	fetches []int               // the n of each Fetch
	taken   map[int][]time.Time // the Outcome.HandedOut of each Settle, by message
	emitted int                 // the messages Emit made deliveries of
}

func newSource(buffer int) *source {
	return &source{ready: make(chan int, buffer), settles: make(chan settled, buffer), closed: make(chan struct{})}
}

func (src *source) Fetch(ctx context.Context, n int) error {
	src.mu.Lock()
	src.fetches = append(src.fetches, n)
	err := src.fetchErr
	src.mu.Unlock()
	if err != nil {
		return err
	}
	for got := 0; got < n; got++ {
		var k int
		if got == 0 {
			select {
			case k = <-src.ready:
			case <-ctx.Done():
				return nil
			}
		} else {
			select {
			case k = <-src.ready:
			default:
				return nil
			}
		}
		it := inflight.Item[int]{Data: k, Msg: message.NewMessage(fmt.Sprint(k), nil), Count: 1}
		if src.deadline > 0 {
			it.Deadline = time.Now().Add(src.deadline)
		}
		if src.sub.Emit(it) == nil {
			return nil
		}
		src.mu.Lock()
		src.emitted++
		src.mu.Unlock()
	}
	return nil
}

// emittedCount returns how many messages Emit made deliveries of so far.
func (src *source) emittedCount() int {
	src.mu.Lock()
	defer src.mu.Unlock()
	return src.emitted
}

// Settle records the settlement; its Outcome.HandedOut goes to taken, apart.
func (src *source) Settle(d *inflight.Delivery[int], o inflight.Outcome) {
	src.mu.Lock()
	if src.taken == nil {
		src.taken = map[int][]time.Time{}
	}
	src.taken[d.Data] = append(src.taken[d.Data], o.HandedOut)
	src.mu.Unlock()
	o.HandedOut = time.Time{}
	src.settles <- settled{n: d.Data, o: o}
}

// takenAt returns the Outcome.HandedOut of each Settle of message n so far.
func (src *source) takenAt(n int) []time.Time {
	src.mu.Lock()
	defer src.mu.Unlock()
	return append([]time.Time(nil), src.taken[n]...)
}

func (src *source) Close(context.Context) error {
	close(src.closed)
	return nil
}

func (src *source) fetchSizes() []int {
	src.mu.Lock()
	defer src.mu.Unlock()
	return append([]int(nil), src.fetches...)
}

// put makes messages 1..n ready at the broker.
func (src *source) put(from, to int) {
	for k := from; k <= to; k++ {
		src.ready <- k
	}
}

// start starts a subscription of src, directly settled or not, with opt and defaults for
// what opt leaves zero.
func start(t *testing.T, g *inflight.Group, src *source, direct bool, opt inflight.Options) (<-chan *message.Message, context.CancelFunc) {
	t.Helper()
	return startAs(t, g, src, src, direct, opt)
}

// startAs starts as start does, with as, a wrapper of src, as the subscription's source.
func startAs(t *testing.T, g *inflight.Group, src *source, as inflight.Source[int], direct bool, opt inflight.Options) (<-chan *message.Message, context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	if direct {
		ctx = redelivery.WithDirectSettle(ctx)
	}
	if opt.Prefetch == 0 {
		opt.Prefetch = 4
	}
	if opt.CloseTimeout == 0 {
		opt.CloseTimeout = 5 * time.Second
	}
	opt.ErrExpired = errExpired
	src.sub = inflight.New(ctx, as, opt)
	ch, err := src.sub.Start(g)
	require.NoError(t, err)
	return ch, cancel
}

func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	return testsvc.Receive(t, ch, 5*time.Second)
}

func settlement(t *testing.T, src *source) settled {
	t.Helper()
	select {
	case s := <-src.settles:
		return s
	case <-time.After(5 * time.Second):
		t.Fatal("no settlement within 5 s")
		return settled{}
	}
}

func noSettlement(t *testing.T, src *source, wait time.Duration) {
	t.Helper()
	select {
	case s := <-src.settles:
		t.Fatalf("unexpected settlement of %d: %+v", s.n, s.o)
	case <-time.After(wait):
	}
}

// settle acks or nacks m as a consumer of either kind does.
func ack(m *message.Message) {
	m.Ack()
	redelivery.Settle(m)
}

func nack(m *message.Message) {
	m.Nack()
	redelivery.Settle(m)
}

func closedWithin(t *testing.T, ch <-chan *message.Message) {
	t.Helper()
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-time.After(5 * time.Second):
			t.Fatal("channel not closed within 5 s")
		}
	}
}

func modes(t *testing.T, f func(t *testing.T, direct bool)) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%t", direct), func(t *testing.T) {
			t.Parallel()
			f(t, direct)
		})
	}
}

func TestWindow_HandsOutPrefetchWithoutAcksAndOnePlacePerSettlement(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(16)
		src.put(1, 6)
		ch, cancel := start(t, nil, src, direct, inflight.Options{Prefetch: 4})
		defer cancel()
		var held []*message.Message
		for range 4 {
			held = append(held, receive(t, ch))
		}
		testsvc.RequireOpenAndNothing(t, ch, 100*time.Millisecond)
		ack(held[0])
		require.Equal(t, settled{n: 1, o: inflight.Outcome{Acked: true}}, settlement(t, src))
		// One place is free, less than half the window: FillWait (zero) has passed, so it is
		// fetched at once, and exactly one more message comes.
		require.Equal(t, "5", receive(t, ch).UUID)
		testsvc.RequireOpenAndNothing(t, ch, 100*time.Millisecond)
	})
}

func TestWindow_SmallRoomWaitsForHalfTheWindowOrFillWaitOrFlush(t *testing.T) {
	src := newSource(16)
	src.put(1, 8)
	ch, cancel := start(t, nil, src, true, inflight.Options{Prefetch: 4, FillWait: time.Hour})
	defer cancel()
	var held []*message.Message
	for range 4 {
		held = append(held, receive(t, ch))
	}
	ack(held[0])
	settlement(t, src)
	testsvc.RequireOpenAndNothing(t, ch, 100*time.Millisecond) // one place of four: it waits for a second
	ack(held[1])
	settlement(t, src)
	require.Equal(t, "5", receive(t, ch).UUID)
	require.Equal(t, "6", receive(t, ch).UUID)
	require.Equal(t, []int{4, 2}, src.fetchSizes())

	ack(held[2])
	settlement(t, src)
	testsvc.RequireOpenAndNothing(t, ch, 100*time.Millisecond)
	redelivery.Flush(held[2]) // the consumer settled a batch and waits for more
	require.Equal(t, "7", receive(t, ch).UUID)
	require.Equal(t, []int{4, 2, 1}, src.fetchSizes())
}

func TestWindow_EagerFetchesAnyRoomAfterAShortFetch(t *testing.T) {
	src := newSource(16)
	src.put(1, 3)
	ch, cancel := start(t, nil, src, true, inflight.Options{Prefetch: 4, FillWait: time.Hour, Eager: true})
	defer cancel()
	for range 3 {
		receive(t, ch)
	}
	// The fetch for 4 brought 3; the next asks for the one place left at once.
	require.Eventually(t, func() bool { return len(src.fetchSizes()) == 2 }, 5*time.Second, time.Millisecond)
	require.Equal(t, []int{4, 1}, src.fetchSizes())
}

func TestSettle_AcksAndNacksReachTheSourceWithTheirDelays(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(16)
		src.put(1, 3)
		ch, cancel := start(t, nil, src, direct, inflight.Options{NackDelay: time.Second})
		defer cancel()
		ack(receive(t, ch))
		require.Equal(t, settled{n: 1, o: inflight.Outcome{Acked: true}}, settlement(t, src))
		nack(receive(t, ch))
		require.Equal(t, settled{n: 2, o: inflight.Outcome{Nacked: true, Delay: time.Second}}, settlement(t, src))
		m := receive(t, ch)
		require.True(t, redelivery.NackAfter(m, 3*time.Second))
		redelivery.Settle(m)
		require.Equal(t, settled{n: 3, o: inflight.Outcome{Nacked: true, Delay: 3 * time.Second}}, settlement(t, src))
		info, ok := redelivery.FromContext(m.Context())
		require.True(t, ok)
		require.Equal(t, redelivery.Info{Count: 1, DelaysNacks: true}, info)
		require.ErrorIs(t, m.Context().Err(), context.Canceled, "a settled delivery's context ends")
		noSettlement(t, src, 50*time.Millisecond)
	})
}

func TestSettle_ASecondSettleOfADeliveryDoesNothing(t *testing.T) {
	src := newSource(4)
	src.put(1, 1)
	ch, cancel := start(t, nil, src, true, inflight.Options{})
	defer cancel()
	m := receive(t, ch)
	ack(m)
	settlement(t, src)
	redelivery.Settle(m)
	m.Nack()
	noSettlement(t, src, 50*time.Millisecond)
}

// Settle says when the consumer took each delivery: for a nack held, at the start and at the
// end of the hold alike; for one never taken, never.
func TestSettle_SaysWhenTheConsumerTookTheDelivery(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(8)
		src.put(1, 3)
		g := inflight.NewGroup(errClosed)
		ch, cancel := start(t, g, src, direct, inflight.Options{Prefetch: 3, HoldNacks: true, NackDelay: 50 * time.Millisecond})
		defer cancel()
		// The pump records the hand-out once the consumer has the message: at the earliest
		// when the consumer begins to receive, at the latest when it settles.
		before := time.Now()
		one := receive(t, ch)
		between := time.Now()
		two := receive(t, ch)
		require.Eventually(t, func() bool { return len(src.ready) == 0 }, 5*time.Second, time.Millisecond)
		ack(one)
		settlement(t, src)
		acked := time.Now()
		nack(two)
		require.True(t, settlement(t, src).o.Held)
		nacked := time.Now()
		settlement(t, src) // the end of the hold
		require.NoError(t, g.Close(nil))
		settlement(t, src) // three, never taken

		within := func(at, from, to time.Time) {
			t.Helper()
			require.False(t, at.Before(from) || at.After(to), "taken at %s, not within %s..%s", at, from, to)
		}
		took := src.takenAt(1)
		require.Len(t, took, 1)
		within(took[0], before, acked)
		took = src.takenAt(2)
		require.Len(t, took, 2)
		require.Equal(t, took[0], took[1])
		within(took[0], between, nacked)
		require.Equal(t, []time.Time{{}}, src.takenAt(3))
	})
}

func TestDeadline_EndsTheDeliveryOnceWithTheAckOrNackGivenBefore(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(8)
		src.deadline = 200 * time.Millisecond
		src.put(1, 3)
		ch, cancel := start(t, nil, src, direct, inflight.Options{Prefetch: 3})
		defer cancel()
		one, two, three := receive(t, ch), receive(t, ch), receive(t, ch)
		one.Ack() // acked, not settled yet (or not seen yet by a watcher)
		_ = two
		got := map[int]inflight.Outcome{}
		for range 2 {
			s := settlement(t, src)
			got[s.n] = s.o
		}
		if direct {
			require.Equal(t, map[int]inflight.Outcome{
				1: {Acked: true, Cause: errExpired},
				2: {Cause: errExpired},
			}, got)
		} else {
			// A watcher sees the ack of one at once.
			require.Equal(t, map[int]inflight.Outcome{1: {Acked: true}, 2: {Cause: errExpired}}, got)
		}
		s := settlement(t, src)
		require.Equal(t, settled{n: 3, o: inflight.Outcome{Cause: errExpired}}, s)
		require.ErrorIs(t, context.Cause(three.Context()), errExpired)
		ack(three) // too late: dropped
		redelivery.Settle(one)
		noSettlement(t, src, 50*time.Millisecond)
	})
}

func TestDeadline_LateAckIsReportedWhenTheSourceAsks(t *testing.T) {
	src := newSource(8)
	src.deadline = 50 * time.Millisecond
	src.put(1, 1)
	ch, cancel := start(t, nil, src, true, inflight.Options{LateAcks: true})
	defer cancel()
	m := receive(t, ch)
	require.Equal(t, settled{n: 1, o: inflight.Outcome{Cause: errExpired}}, settlement(t, src))
	ack(m)
	require.Equal(t, settled{n: 1, o: inflight.Outcome{Acked: true, Late: true}}, settlement(t, src))
}

func TestDeadline_AckTimeoutCountsFromTheHandOut(t *testing.T) {
	src := newSource(8)
	src.put(1, 1)
	ch, cancel := start(t, nil, src, true, inflight.Options{AckTimeout: 100 * time.Millisecond})
	defer cancel()
	time.Sleep(300 * time.Millisecond) // queued, not handed out: its time does not run
	m := receive(t, ch)
	require.NoError(t, m.Context().Err())
	require.Equal(t, settled{n: 1, o: inflight.Outcome{Cause: errExpired}}, settlement(t, src))
}

func TestHold_NackIsHeldForItsDelayOutOfTheWindow(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(8)
		src.put(1, 2)
		ch, cancel := start(t, nil, src, direct, inflight.Options{Prefetch: 1, HoldNacks: true, NackDelay: 300 * time.Millisecond})
		defer cancel()
		start := time.Now()
		m := receive(t, ch)
		nack(m)
		// The source learns that the hold begins, its place is free at once: the next message
		// comes while the nack is held.
		require.Equal(t, settled{n: 1, o: inflight.Outcome{Nacked: true, Delay: 300 * time.Millisecond, Held: true}}, settlement(t, src))
		require.ErrorIs(t, m.Context().Err(), context.Canceled, "a held delivery's context ends")
		require.Equal(t, "2", receive(t, ch).UUID)
		s := settlement(t, src)
		require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
		require.Equal(t, settled{n: 1, o: inflight.Outcome{Nacked: true}}, s)
	})
}

// A hold shorter than anything the source does as it begins still ends after it began: the
// source learns of its start first, and of its end once.
func TestHold_TheSourceLearnsOfTheStartBeforeTheEnd(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		const n = 50
		src := &slowHold{source: newSource(2 * n)}
		src.put(1, n)
		ch, cancel := startAs(t, nil, src.source, src, direct, inflight.Options{Prefetch: n, HoldNacks: true})
		defer cancel()
		for range n {
			m := receive(t, ch)
			require.True(t, redelivery.NackAfter(m, time.Nanosecond))
			redelivery.Settle(m)
		}
		seen := map[int]bool{}
		for range 2 * n {
			s := settlement(t, src.source)
			require.Equal(t, !seen[s.n], s.o.Held, "message %d: %+v", s.n, s.o)
			seen[s.n] = true
		}
		noSettlement(t, src.source, 50*time.Millisecond)
	})
}

// slowHold takes its time over the start of a hold.
type slowHold struct{ *source }

func (h *slowHold) Settle(d *inflight.Delivery[int], o inflight.Outcome) {
	if o.Held {
		time.Sleep(time.Millisecond)
	}
	h.source.Settle(d, o)
}

// The end of a subscription waits for a hold that is beginning, and then ends it with the
// others.
func TestHold_TheEndWaitsForAHoldThatIsBeginning(t *testing.T) {
	src := &blockedHold{source: newSource(4), entered: make(chan struct{}), release: make(chan struct{})}
	src.put(1, 1)
	g := inflight.NewGroup(errClosed)
	ctx := redelivery.WithDirectSettle(context.Background())
	src.sub = inflight.New[int](ctx, src, inflight.Options{Prefetch: 1, HoldNacks: true, NackDelay: time.Hour, CloseTimeout: 5 * time.Second})
	ch, err := src.sub.Start(g)
	require.NoError(t, err)
	go nack(receive(t, ch))
	<-src.entered
	closed := make(chan error, 1)
	go func() { closed <- g.Close(nil) }()
	select {
	case <-src.closed:
		t.Fatal("the source was closed while a hold was beginning")
	case <-time.After(100 * time.Millisecond):
	}
	close(src.release)
	require.NoError(t, <-closed)
	s := settlement(t, src.source)
	require.True(t, s.o.Held)
	s = settlement(t, src.source)
	require.Equal(t, errClosed, s.o.Cause)
	require.True(t, s.o.Nacked)
	require.False(t, s.o.Held)
}

// blockedHold blocks the start of a hold until release is closed.
type blockedHold struct {
	*source
	entered, release chan struct{}
}

func (h *blockedHold) Settle(d *inflight.Delivery[int], o inflight.Outcome) {
	if o.Held {
		close(h.entered)
		<-h.release
	}
	h.source.Settle(d, o)
}

func TestHold_NackWithoutDelayIsToldAtOnce(t *testing.T) {
	src := newSource(8)
	src.put(1, 1)
	ch, cancel := start(t, nil, src, true, inflight.Options{HoldNacks: true})
	defer cancel()
	nack(receive(t, ch))
	require.Equal(t, settled{n: 1, o: inflight.Outcome{Nacked: true}}, settlement(t, src))
}

func TestEnd_EndsTheMatchingDeliveriesAndTheOthersGoOn(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(8)
		src.put(1, 3)
		ch, cancel := start(t, nil, src, direct, inflight.Options{Prefetch: 2, HoldNacks: true, NackDelay: time.Hour})
		defer cancel()
		one, two := receive(t, ch), receive(t, ch)
		nack(one) // held
		require.True(t, settlement(t, src).o.Held)
		require.Equal(t, "3", receive(t, ch).UUID)
		two.Ack()
		n := src.sub.End(errLost, func(d *inflight.Delivery[int]) bool { return d.Data <= 2 })
		got := map[int]inflight.Outcome{}
		for range 2 {
			s := settlement(t, src)
			got[s.n] = s.o
		}
		if direct {
			require.Equal(t, 2, n)
			require.Equal(t, inflight.Outcome{Acked: true, Cause: errLost}, got[2])
		} else {
			// The watcher may have seen the ack of two before the End.
			require.Contains(t, []inflight.Outcome{{Acked: true, Cause: errLost}, {Acked: true}}, got[2])
		}
		require.Equal(t, errLost, got[1].Cause)
		require.True(t, got[1].Nacked)
		require.InDelta(t, float64(time.Hour), float64(got[1].Delay), float64(time.Minute))
		require.ErrorIs(t, context.Cause(two.Context()), errLost)
		noSettlement(t, src, 50*time.Millisecond)
	})
}

func TestEnd_AQueuedDeliveryThatEndsIsNotHandedOut(t *testing.T) {
	src := newSource(8)
	src.put(1, 2)
	ch, cancel := start(t, nil, src, true, inflight.Options{Prefetch: 2})
	defer cancel()
	require.Eventually(t, func() bool { return len(src.ready) == 0 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 1, src.sub.End(errLost, func(d *inflight.Delivery[int]) bool { return d.Data == 1 }))
	require.Equal(t, settled{n: 1, o: inflight.Outcome{Cause: errLost}}, settlement(t, src))
	require.Equal(t, "2", receive(t, ch).UUID)
}

func TestWithdraw_EndsOnlyTheDeliveriesNotHandedOutYet(t *testing.T) {
	src := newSource(8)
	src.put(1, 3)
	ch, cancel := start(t, nil, src, true, inflight.Options{Prefetch: 3})
	defer cancel()
	one := receive(t, ch)
	require.Eventually(t, func() bool { return len(src.ready) == 0 }, 5*time.Second, time.Millisecond)
	// Two is in the pump's hands, three queued behind it: neither is the consumer's yet.
	require.Equal(t, 2, src.sub.Withdraw(errLost, func(*inflight.Delivery[int]) bool { return true }))
	got := map[int]inflight.Outcome{}
	for range 2 {
		s := settlement(t, src)
		got[s.n] = s.o
	}
	require.Equal(t, map[int]inflight.Outcome{2: {Cause: errLost}, 3: {Cause: errLost}}, got)
	testsvc.RequireOpenAndNothing(t, ch, 100*time.Millisecond)
	require.NoError(t, one.Context().Err(), "the delivery the consumer has goes on")
	ack(one)
	require.Equal(t, settled{n: 1, o: inflight.Outcome{Acked: true}}, settlement(t, src))
}

func TestStop_GivesBackWhatItHoldsWithWhatTheConsumerGaveThenClosesTheChannel(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(8)
		src.put(1, 4)
		g := inflight.NewGroup(errClosed)
		ch, cancel := start(t, g, src, direct, inflight.Options{Prefetch: 4, HoldNacks: true, NackDelay: time.Hour})
		defer cancel()
		one, two, three := receive(t, ch), receive(t, ch), receive(t, ch)
		nack(one) // held
		require.True(t, settlement(t, src).o.Held)
		require.Equal(t, "4", receive(t, ch).UUID) // four: handed out, unsettled
		two.Ack()                                  // acked, not settled yet
		_ = three
		require.NoError(t, g.Close(nil))
		got := map[int]inflight.Outcome{}
		for range 4 {
			s := settlement(t, src)
			got[s.n] = s.o
		}
		require.Equal(t, errClosed, got[1].Cause, "%+v", got)
		require.True(t, got[1].Nacked)
		if direct {
			require.Equal(t, inflight.Outcome{Acked: true, Cause: errClosed}, got[2])
		} else {
			require.Contains(t, []inflight.Outcome{{Acked: true, Cause: errClosed}, {Acked: true}}, got[2])
		}
		require.Equal(t, inflight.Outcome{Cause: errClosed}, got[3])
		require.Equal(t, inflight.Outcome{Cause: errClosed}, got[4])
		select {
		case <-src.closed:
		default:
			t.Fatal("the source was not closed")
		}
		closedWithin(t, ch)
		require.ErrorIs(t, context.Cause(three.Context()), errClosed)
		ack(three) // after the end: dropped
		noSettlement(t, src, 50*time.Millisecond)
	})
}

// The end of a subscription reports the ack it reads from a message once: the consumer's
// settlement that follows is not a late ack, even for a source that asks for those.
func TestStop_ReportsAnAckItReadsOnceEvenWithLateAcks(t *testing.T) {
	modes(t, func(t *testing.T, direct bool) {
		src := newSource(8)
		src.put(1, 1)
		g := inflight.NewGroup(errClosed)
		ch, cancel := start(t, g, src, direct, inflight.Options{LateAcks: true})
		defer cancel()
		one := receive(t, ch)
		one.Ack() // acked, not settled yet
		require.NoError(t, g.Close(nil))
		s := settlement(t, src)
		require.Equal(t, 1, s.n)
		require.True(t, s.o.Acked, "%+v", s.o)
		require.False(t, s.o.Late, "%+v", s.o)
		redelivery.Settle(one)
		noSettlement(t, src, 50*time.Millisecond)
	})
}

func TestStop_AMessageNeverHandedOutSaysSo(t *testing.T) {
	src := newSource(8)
	src.put(1, 2)
	var handed []bool
	var mu sync.Mutex
	wrapped := &handOutSource{source: src, handed: func(b bool) { mu.Lock(); handed = append(handed, b); mu.Unlock() }}
	ctx, cancel := context.WithCancel(redelivery.WithDirectSettle(context.Background()))
	src.sub = inflight.New[int](ctx, wrapped, inflight.Options{Prefetch: 2, CloseTimeout: time.Second})
	ch, err := src.sub.Start(nil)
	require.NoError(t, err)
	receive(t, ch)
	// Both are deliveries before the end: a message that Emit refuses once the subscription
	// stops is the source's to give back, and never reaches Settle.
	require.Eventually(t, func() bool { return src.emittedCount() == 2 }, 5*time.Second, time.Millisecond)
	cancel()
	<-src.closed // not reading meanwhile: the second stays unhanded
	_, ok := <-ch
	require.False(t, ok)
	mu.Lock()
	defer mu.Unlock()
	require.ElementsMatch(t, []bool{true, false}, handed)
}

// handOutSource records, for each delivery settled, whether it was handed out.
type handOutSource struct {
	*source
	handed func(bool)
}

func (h *handOutSource) Settle(d *inflight.Delivery[int], o inflight.Outcome) {
	h.handed(d.HandedOut())
	h.source.Settle(d, o)
}

func TestStop_TheSubscribeContextEndsOnlyItsSubscription(t *testing.T) {
	g := inflight.NewGroup(errClosed)
	a, b := newSource(8), newSource(8)
	a.put(1, 1)
	b.put(1, 1)
	chA, cancelA := start(t, g, a, true, inflight.Options{})
	chB, cancelB := start(t, g, b, true, inflight.Options{})
	defer cancelB()
	mA := receive(t, chA)
	receive(t, chB)
	cancelA()
	closedWithin(t, chA)
	require.Equal(t, settled{n: 1, o: inflight.Outcome{Cause: context.Canceled}}, settlement(t, a))
	require.ErrorIs(t, context.Cause(mA.Context()), context.Canceled)
	b.put(2, 2)
	require.Equal(t, "2", receive(t, chB).UUID)
}

func TestStop_AFetchErrorEndsTheSubscription(t *testing.T) {
	src := newSource(8)
	src.fetchErr = errors.New("broker gone")
	ch, cancel := start(t, nil, src, true, inflight.Options{})
	defer cancel()
	closedWithin(t, ch)
}

func TestContext_EndsWithTheCauseWhenTheSubscriptionStopsOrCannotStart(t *testing.T) {
	g := inflight.NewGroup(errClosed)
	src := newSource(8)
	ch, cancel := start(t, g, src, true, inflight.Options{})
	defer cancel()
	require.NoError(t, src.sub.Context().Err(), "running")
	require.NoError(t, g.Close(nil))
	closedWithin(t, ch)
	require.ErrorIs(t, context.Cause(src.sub.Context()), errClosed)

	other := newSource(1)
	other.sub = inflight.New[int](context.Background(), other, inflight.Options{Prefetch: 1})
	_, err := other.sub.Start(g)
	require.ErrorIs(t, err, errClosed)
	require.ErrorIs(t, context.Cause(other.sub.Context()), errClosed, "a subscription that did not start")
}

func TestGroup_CloseIsIdempotentAndRefusesNewSubscriptions(t *testing.T) {
	g := inflight.NewGroup(errClosed)
	src := newSource(8)
	ch, cancel := start(t, g, src, true, inflight.Options{})
	defer cancel()
	afters := 0
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() { require.NoError(t, g.Close(func() error { afters++; return nil })) })
	}
	wg.Wait()
	require.Equal(t, 1, afters)
	closedWithin(t, ch)
	require.ErrorIs(t, g.Check(), errClosed)
	require.ErrorIs(t, context.Cause(g.Context()), errClosed)
	other := newSource(1)
	other.sub = inflight.New[int](context.Background(), other, inflight.Options{Prefetch: 1})
	_, err := other.sub.Start(g)
	require.ErrorIs(t, err, errClosed)
}

func TestGroup_CloseReportsTheSourcesErrors(t *testing.T) {
	g := inflight.NewGroup(errClosed)
	src := &failingClose{source: newSource(1)}
	ctx := context.Background()
	src.sub = inflight.New[int](ctx, src, inflight.Options{Prefetch: 1, CloseTimeout: time.Second})
	_, err := src.sub.Start(g)
	require.NoError(t, err)
	err = g.Close(func() error { return errors.New("connection") })
	require.ErrorContains(t, err, "unsent acks")
	require.ErrorContains(t, err, "connection")
}

type failingClose struct{ *source }

func (f *failingClose) Close(context.Context) error { return errors.New("unsent acks") }

func TestRules_ValidateNamesTheField(t *testing.T) {
	r := inflight.Rules{Scheme: "x", Prefetch: 10, MaxPrefetch: 100, AckTimeout: time.Minute, AckTimeoutField: "AckWait",
		MinAckTimeout: 10 * time.Millisecond, NackDelay: time.Second, NoNackDelay: true, CloseTimeout: 5 * time.Second}
	for _, c := range []struct {
		s   inflight.Settings
		err string
	}{
		{inflight.Settings{Prefetch: -1}, "x: Config.Prefetch: -1 is outside 1..100 (0 selects the default)"},
		{inflight.Settings{Prefetch: 101}, "x: Config.Prefetch: 101 is outside 1..100 (0 selects the default)"},
		{inflight.Settings{NackDelay: -2}, "x: Config.NackDelay: -2ns is negative (0 selects the default, NoNackDelay disables the delay)"},
		{inflight.Settings{AckTimeout: -1}, "x: Config.AckWait: -1ns is negative (0 selects the default)"},
		{inflight.Settings{AckTimeout: time.Millisecond}, "x: Config.AckWait: 1ms is shorter than 10ms"},
		{inflight.Settings{CloseTimeout: -1}, "x: Config.CloseTimeout: -1ns is negative (0 selects the default)"},
	} {
		require.EqualError(t, r.Validate(c.s), c.err)
	}
	require.NoError(t, r.Validate(inflight.Settings{NackDelay: -1}))
	require.EqualError(t, r.Validate(inflight.Settings{}, inflight.Duration{Name: "BlockTime"}, inflight.Duration{Name: "ClaimInterval", Value: -1}),
		"x: Config.ClaimInterval: -1ns is negative (0 selects the default)")
	require.EqualError(t, r.Validate(inflight.Settings{Prefetch: -1}, inflight.Duration{Name: "BlockTime", Value: -1}),
		"x: Config.Prefetch: -1 is outside 1..100 (0 selects the default)", "the common settings first")

	require.EqualError(t, r.Validate(inflight.Settings{}, inflight.Duration{Name: "Resend", Value: time.Microsecond, Min: time.Millisecond}),
		"x: Config.Resend: 1µs is shorter than 1ms (0 selects the default)")
	require.NoError(t, r.Validate(inflight.Settings{}, inflight.Duration{Name: "Resend", Min: time.Millisecond}))

	plain := inflight.Rules{Scheme: "y", PrefetchField: "BatchSize"}
	require.EqualError(t, plain.Validate(inflight.Settings{NackDelay: -1}), "y: Config.NackDelay: -1ns is negative (0 redelivers at once)")
	require.EqualError(t, plain.Validate(inflight.Settings{Prefetch: -1}), "y: Config.BatchSize: -1 is negative (0 selects the default)")
	require.NoError(t, plain.Validate(inflight.Settings{AckTimeout: -1}), "a scheme without deadlines does not read AckTimeout")
}

func TestRules_DefaultSetsTheFieldsButPrefetch(t *testing.T) {
	r := inflight.Rules{Scheme: "x", Prefetch: 10, AckTimeout: time.Minute, NackDelay: time.Second, NoNackDelay: true, CloseTimeout: 5 * time.Second}
	var (
		prefetch           int
		ack, nack, closing time.Duration = 0, -1, 0
		logger             *slog.Logger
		log                watermill.LoggerAdapter
	)
	f := inflight.Fields{Prefetch: &prefetch, AckTimeout: &ack, NackDelay: &nack, CloseTimeout: &closing, Logger: &logger, Log: &log}
	require.Equal(t, inflight.Settings{NackDelay: -1}, f.Settings())
	r.Default(f)
	require.Equal(t, []time.Duration{time.Minute, 0, 5 * time.Second}, []time.Duration{ack, nack, closing})
	require.Zero(t, prefetch, "each subscription takes its own Window")
	require.NotNil(t, logger)
	require.Equal(t, watermill.NopLogger{}, log, "a discarding logger logs nothing at no cost")

	nack = 0
	r.Default(f)
	require.Equal(t, time.Second, nack, "0 selects the default")

	nack = 0
	inflight.Rules{Scheme: "y"}.Default(inflight.Fields{Prefetch: &prefetch, NackDelay: &nack, CloseTimeout: &closing, Logger: &logger, Log: &log})
	require.Zero(t, nack, "a scheme without deadlines has no AckTimeout field to set")
}

// keeper keeps every place of its first fetch, for messages it emits later from elsewhere;
// its later fetches wait for next.
type keeper struct {
	*source
	once sync.Once
	kept int // what Keep returned, under mu
	next chan struct{}
}

func (k *keeper) Fetch(ctx context.Context, n int) error {
	k.mu.Lock()
	k.fetches = append(k.fetches, n)
	k.mu.Unlock()
	first := false
	k.once.Do(func() {
		kept := k.sub.Keep(n + 1)
		k.mu.Lock()
		k.kept, first = kept, true
		k.mu.Unlock()
	})
	if !first {
		select {
		case <-k.next:
		case <-ctx.Done():
		}
	}
	return nil
}

func TestKeep_PlacesKeptAfterAFetchAreTakenByLaterEmitsUntilReleased(t *testing.T) {
	src := &keeper{source: newSource(8), next: make(chan struct{})}
	ctx, cancel := context.WithCancel(redelivery.WithDirectSettle(context.Background()))
	defer cancel()
	src.sub = inflight.New[int](ctx, src, inflight.Options{Prefetch: 4, CloseTimeout: time.Second})
	ch, err := src.sub.Start(nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(src.fetchSizes()) == 1 }, 5*time.Second, time.Millisecond)
	src.mu.Lock()
	require.Equal(t, 4, src.kept, "Keep keeps no more than the fetch reserved")
	src.mu.Unlock()
	for k := 1; k <= 2; k++ {
		require.NotNil(t, src.sub.Emit(inflight.Item[int]{Data: k, Msg: message.NewMessage(fmt.Sprint(k), nil), Kept: true}))
	}
	ack(receive(t, ch))
	settlement(t, src.source)
	// Two places kept, one delivery: one place is free, and fetched.
	require.Eventually(t, func() bool { return len(src.fetchSizes()) == 2 }, 5*time.Second, time.Millisecond)
	require.Equal(t, []int{4, 1}, src.fetchSizes())
	src.sub.Release(2) // the two kept places are given back
	src.next <- struct{}{}
	require.Eventually(t, func() bool { return len(src.fetchSizes()) == 3 }, 5*time.Second, time.Millisecond)
	require.Equal(t, []int{4, 1, 3}, src.fetchSizes())
}

func TestGroup_BeginRefusesAnEmptyTopicThenAClosedGroup(t *testing.T) {
	t.Parallel()
	g := inflight.NewGroup(errClosed)
	require.NoError(t, g.Begin("x", "t"))
	require.EqualError(t, g.Begin("x", ""), "x: subscribe: topic is empty")
	require.NoError(t, g.Close(nil))
	require.EqualError(t, g.Begin("x", ""), "x: subscribe: topic is empty", "the topic first")
	require.ErrorIs(t, g.Begin("x", "t"), errClosed)
}
