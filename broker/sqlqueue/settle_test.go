package sqlqueue_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// The tests of this file subscribe as the router does (redelivery.WithDirectSettle) and call
// redelivery.Settle after each ack and nack: the subscription takes the settlement in that
// call, not when it sees the ack.

// forEachDatabaseDirect runs test as a parallel subtest on PostgreSQL and on MariaDB, with a
// consumer that settles directly.
func forEachDatabaseDirect(t *testing.T, test func(t *testing.T, e *env)) {
	for _, d := range databases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, d.name, d.url(t))
			e.direct = true
			test(t, e)
		})
	}
}

func TestSubscriber_DirectSettleFreesThePlaceAndEndsTheContext(t *testing.T) {
	t.Parallel()
	forEachDatabaseDirect(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{Prefetch: 1})
		tp := topic()
		ids := e.publish(q, tp, "m", 3)
		_, ch := e.subscribe(q, tp)

		first := receive(t, ch)
		require.Equal(t, ids[0], first.UUID)
		ack(first)
		require.Error(t, first.Context().Err(), "Settle ends the context of the message it settles")
		second := receive(t, ch)
		require.Equal(t, ids[1], second.UUID)

		second.Ack()
		requireNothing(t, ch, 300*time.Millisecond) // acked, not settled: the place is still taken
		redelivery.Settle(second)
		third := receive(t, ch)
		require.Equal(t, ids[2], third.UUID)
		ack(third)
		requireNothing(t, ch, 300*time.Millisecond)
		testsvc.Eventually(t, receiveWithin, func() bool { return e.leases(tp) == 0 }, "an ack's lease is left")
	})
}

// A delivery whose lease passed frees its place once: the settlement that comes late frees
// none, and its ack changes nothing.
func TestSubscriber_DirectLateSettleAfterTheLeaseFreesNoOtherPlace(t *testing.T) {
	t.Parallel()
	forEachDatabaseDirect(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{Prefetch: 1, AckTimeout: time.Second})
		tp := topic()
		id := e.publish(q, tp, "m", 1)[0]
		_, ch := e.subscribe(q, tp)

		first := receive(t, ch)
		require.Equal(t, id, first.UUID)
		select {
		case <-first.Context().Done():
			require.ErrorIs(t, first.Context().Err(), context.DeadlineExceeded)
		case <-time.After(receiveWithin):
			t.Fatal("the context did not end with the lease")
		}
		again := receive(t, ch)
		require.Equal(t, id, again.UUID)
		info, _ := redelivery.FromContext(again.Context())
		require.Equal(t, 2, info.Count)
		other := e.publish(q, tp, "n", 1)[0]

		ack(first) // late: the lease is the second delivery's
		requireNothing(t, ch, 300*time.Millisecond)
		ack(again)
		next := receive(t, ch)
		require.Equal(t, other, next.UUID)
		ack(next)
		requireNothing(t, ch, 300*time.Millisecond)
		testsvc.Eventually(t, receiveWithin, func() bool { return e.leases(tp) == 0 }, "an ack's lease is left")
	})
}

// Close writes an ack given before it whose Settle comes after, and gives back the delivery
// not acked.
func TestSubscriber_DirectCloseWritesAnAckGivenBeforeIt(t *testing.T) {
	t.Parallel()
	forEachDatabaseDirect(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{Prefetch: 3, AckTimeout: time.Minute})
		tp := topic()
		ids := e.publish(q, tp, "m", 3)
		s, ch := e.subscribe(q, tp)
		first, second, third := receive(t, ch), receive(t, ch), receive(t, ch)
		require.Equal(t, ids, []string{first.UUID, second.UUID, third.UUID})
		ack(first)
		second.Ack() // its Settle comes after Close

		require.NoError(t, s.Close())
		redelivery.Settle(second)
		require.Equal(t, 1, e.leases(tp), "the lease of the one not acked is left, given back")
		_, next := e.subscribe(q, tp)
		m := receive(t, next)
		require.Equal(t, ids[2], m.UUID)
		info, _ := redelivery.FromContext(m.Context())
		require.Equal(t, 2, info.Count)
		ack(m)
		requireNothing(t, next, 300*time.Millisecond)
	})
}

// leases returns how many leases topic's lease table holds.
func (e *env) leases(topic string) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.Get(&n, `SELECT COUNT(*) FROM `+e.leasesTable(topic)))
	return n
}

// A consumer that settles a batch together and flushes it (redelivery.Flush, as the router
// does after a group's acks) gets the room it freed claimed at once, though that is less than
// half the window, which the subscription waits for otherwise (or PollInterval, here an hour).
func TestSubscriber_DirectFlushClaimsTheFreeRoomAtOnce(t *testing.T) {
	t.Parallel()
	forEachDatabaseDirect(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{Prefetch: 10, PollInterval: time.Hour})
		tp := topic()
		ids := e.publishTogether(q, tp, "m", 20)
		_, ch := e.subscribe(q, tp)
		// The subscription's first claim may come before the messages are in view; they come
		// into view together, and the claim that finds them takes 10.
		got := []*message.Message{wakeUntilClaimed(t, q, tp, ch)}
		require.Equal(t, ids[0], got[0].UUID)
		for i := 1; i < 10; i++ {
			m := receive(t, ch)
			require.Equal(t, ids[i], m.UUID)
			got = append(got, m)
		}
		for _, m := range got[:3] {
			ack(m)
		}
		requireNothing(t, ch, 300*time.Millisecond) // 3 places free, less than half the window
		redelivery.Flush(got[2])
		for i := 10; i < 13; i++ {
			m := receive(t, ch)
			require.Equal(t, ids[i], m.UUID)
			got = append(got, m)
		}
		requireNothing(t, ch, 300*time.Millisecond) // the window is full again
		for _, m := range got[3:] {
			ack(m)
		}
	})
}
