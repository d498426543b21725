package sqlqueue_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// The tests of this file subscribe as the router does (redelivery.WithDirectSettle) and call
// redelivery.Settle after each ack and nack (the window, the hand-out and the settlement
// itself are the in-flight engine's, and its tests cover them).

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
		testsvc.RequireNothing(t, next, 300*time.Millisecond)
	})
}

// leases returns how many leases topic's lease table holds.
func (e *env) leases(topic string) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.Get(&n, `SELECT COUNT(*) FROM `+e.leasesTable(topic)))
	return n
}
