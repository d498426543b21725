package sqlqueue_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestSubscriber_DeliversEachMessageAsPublishedWithCountOne(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{})
		tp := topic()
		ids := e.publish(q, tp, "m", 3)
		_, ch := e.subscribe(q, tp)
		for i, id := range ids {
			m := receive(t, ch)
			require.Equal(t, id, m.UUID)
			require.Equal(t, fmt.Sprintf("payload %d \x00\xff", i), string(m.Payload))
			require.Equal(t, fmt.Sprint(i), m.Metadata.Get("i"))
			info, ok := redelivery.FromContext(m.Context())
			require.True(t, ok, "the context carries a redelivery.Info")
			require.Equal(t, redelivery.Info{Count: 1, DelaysNacks: true}, info)
			ack(m)
		}
	})
}

func TestSubscriber_NackAfterComesBackNoSoonerWithCountPlusOne(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{})
		tp := topic()
		ids := e.publish(q, tp, "m", 1)
		_, ch := e.subscribe(q, tp)
		m := receive(t, ch)
		require.Equal(t, ids[0], m.UUID)
		const delay = 700 * time.Millisecond
		nacked := time.Now()
		require.True(t, nackAfter(m, delay))

		again := receive(t, ch)
		require.GreaterOrEqual(t, time.Since(nacked), delay)
		require.Equal(t, ids[0], again.UUID)
		info, _ := redelivery.FromContext(again.Context())
		require.Equal(t, 2, info.Count)
		require.False(t, info.First())
		ack(again)
	})
}

// A due lease whose message row is gone (deleted by hand while leased) is deleted by the claim
// that finds it, and nothing is delivered for it (it would come first); the due lease claimed
// with it is delivered again, its count one higher.
func TestSubscriber_DueLeaseOfADeletedMessageIsDeleted(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{Prefetch: 2})
		tp := topic()
		ids := e.publish(q, tp, "m", 2)
		_, ch := e.subscribe(q, tp)
		m0, m1 := receive(t, ch), receive(t, ch)
		_, err := e.db.Exec(e.db.Rebind("DELETE FROM "+e.messagesTable(tp)+" WHERE uuid = ?"), m0.UUID)
		require.NoError(t, err)
		nack(m0)
		nack(m1)

		again := receive(t, ch)
		require.Equal(t, ids[1], again.UUID)
		info, _ := redelivery.FromContext(again.Context())
		require.Equal(t, 2, info.Count)
		ack(again)
		testsvc.Eventually(t, 10*time.Second, func() bool { return e.leases(tp) == 0 },
			"the lease of the deleted message, and the acknowledged one, are deleted")
	})
}

func TestSubscriber_NackedMessageDoesNotHoldUpTheOnesBehindIt(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const good = 100
		const delay = 5 * time.Second
		q := e.queue(sqlqueue.Config{Prefetch: 10})
		tp := topic()
		poison := e.publish(q, tp, "poison", 1)[0]
		ids := e.publish(q, tp, "good", good)
		_, ch := e.subscribe(q, tp)

		acked := map[string]int{}
		var nackedAt time.Time
		poisonDeliveries := 0
		for len(acked) < good {
			m := receive(t, ch)
			if m.UUID == poison {
				poisonDeliveries++
				require.Equal(t, 1, poisonDeliveries, "the poison message came back before its delay")
				nackedAt = time.Now()
				require.True(t, nackAfter(m, delay))
				continue
			}
			acked[m.UUID]++
			ack(m)
		}
		require.Less(t, time.Since(nackedAt), delay, "all good messages were acked while the poison message waited")
		for _, id := range ids {
			require.Equal(t, 1, acked[id], "message %s", id)
		}

		m := receive(t, ch)
		require.Equal(t, poison, m.UUID)
		require.GreaterOrEqual(t, time.Since(nackedAt), delay)
		info, _ := redelivery.FromContext(m.Context())
		require.Equal(t, 2, info.Count)
		ack(m)
		testsvc.RequireNothing(t, ch, 300*time.Millisecond)
	})
}

func TestSubscriber_AckRightBeforeCloseIsNotRedelivered(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{})
		tp := topic()
		ids := e.publish(q, tp, "m", 2)
		a, chA := e.subscribe(q, tp)
		first, second := receive(t, chA), receive(t, chA)
		require.Equal(t, ids, []string{first.UUID, second.UUID})
		ack(first)
		require.NoError(t, a.Close())
		_, open := <-chA
		require.False(t, open, "Close closes the channel")

		sentinel := e.publish(q, tp, "sentinel", 1)[0]
		_, chB := e.subscribe(q, tp)
		m := receive(t, chB)
		require.Equal(t, ids[1], m.UUID, "the unsettled message, given back; not the acked one")
		ack(m)
		m = receive(t, chB)
		require.Equal(t, sentinel, m.UUID)
		ack(m)
		testsvc.RequireNothing(t, chB, 300*time.Millisecond)
	})
}

func TestSubscriber_CloseGivesBackUnsettledDeliveriesAtOnce(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const ackTimeout = time.Minute
		q := e.queue(sqlqueue.Config{Prefetch: 4, AckTimeout: ackTimeout})
		tp := topic()
		ids := e.publish(q, tp, "m", 4)
		a, chA := e.subscribe(q, tp)
		// Two handed out; the third waits to be handed out, the fourth behind it: all four
		// are claimed.
		first, second := receive(t, chA), receive(t, chA)
		require.Equal(t, ids[:2], []string{first.UUID, second.UUID})
		// A PostgreSQL claim passes no message newer than the oldest transaction running in
		// the cluster, which another test may hold open: B subscribes once A has all four.
		require.Eventually(t, func() bool { return e.leases(tp) == len(ids) }, receiveWithin, 10*time.Millisecond)
		_, chB := e.subscribe(q, tp)
		testsvc.RequireNothing(t, chB, 300*time.Millisecond)

		closed := time.Now()
		require.NoError(t, a.Close())
		require.Error(t, first.Context().Err(), "Close cancels the contexts of unsettled deliveries")
		counts := map[string]int{}
		for range ids {
			m := receive(t, chB)
			info, _ := redelivery.FromContext(m.Context())
			counts[m.UUID] = info.Count
			ack(m)
		}
		require.Less(t, time.Since(closed), ackTimeout/2, "given back at once, not after the lease")
		require.Equal(t, map[string]int{ids[0]: 2, ids[1]: 2, ids[2]: 1, ids[3]: 1}, counts,
			"the handed-out ones were delivered once before; the others never were")
	})
}

func TestSubscriber_LeaseExpiryCancelsTheContextAndALateAckChangesNothing(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const ackTimeout = time.Second
		q := e.queue(sqlqueue.Config{AckTimeout: ackTimeout})
		tp := topic()
		id := e.publish(q, tp, "m", 1)[0]
		_, ch := e.subscribe(q, tp)
		first := receive(t, ch)
		select {
		case <-first.Context().Done():
			require.ErrorIs(t, context.Cause(first.Context()), context.DeadlineExceeded)
		case <-time.After(receiveWithin):
			t.Fatal("the context did not end with the lease")
		}
		second := receive(t, ch)
		require.Equal(t, id, second.UUID)
		info, _ := redelivery.FromContext(second.Context())
		require.Equal(t, 2, info.Count)

		ack(first) // the lease is the second delivery's now: nothing happens
		third := receive(t, ch)
		info, _ = redelivery.FromContext(third.Context())
		require.Equal(t, 3, info.Count, "the late ack of the first delivery did not settle the second")
		ack(third)
		testsvc.RequireNothing(t, ch, 2*ackTimeout)
	})
}

func TestSubscriber_CompetingConsumersNeverHoldTheSameMessage(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const n = 300
		q := e.queue(sqlqueue.Config{Prefetch: 8})
		tp := topic()
		ids := e.publish(q, tp, "m", n)

		var mu sync.Mutex
		holder := map[string]int{} // message -> consumer that holds it
		received := map[string]int{}
		perConsumer := [2]int{}
		done := make(chan struct{})
		var wg sync.WaitGroup
		for c := range 2 {
			_, ch := e.subscribe(q, tp)
			wg.Go(func() {
				for {
					select {
					case <-done:
						return
					case m := <-ch:
						mu.Lock()
						if other, ok := holder[m.UUID]; ok {
							mu.Unlock()
							t.Errorf("consumer %d got %s while consumer %d holds it", c, m.UUID, other)
							return
						}
						holder[m.UUID] = c
						received[m.UUID]++
						perConsumer[c]++
						all := len(received) == n
						mu.Unlock()
						go func() {
							time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond) // processing
							mu.Lock()
							delete(holder, m.UUID)
							mu.Unlock()
							ack(m)
						}()
						if all {
							close(done)
						}
					}
				}
			})
		}
		select {
		case <-done:
		case <-time.After(2 * receiveWithin):
			t.Fatalf("only %d of %d messages received", len(received), n)
		}
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			require.Equal(t, 1, received[id], "message %s", id)
		}
		t.Logf("consumer 0 got %d, consumer 1 got %d", perConsumer[0], perConsumer[1])
	})
}
