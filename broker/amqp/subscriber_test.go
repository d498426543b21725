package amqp_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// requireFirst checks the redelivery.Info of a first delivery on queue type qt.
func requireFirst(t *testing.T, qt amqp.QueueType, m *message.Message) {
	t.Helper()
	info := testsvc.Info(t, m)
	require.True(t, info.DelaysNacks)
	require.True(t, info.First(), "message %s: %+v", m.UUID, info)
	if qt == amqp.Quorum {
		require.Equal(t, redelivery.Info{Count: 1, DelaysNacks: true}, info)
	} else {
		require.Equal(t, redelivery.Info{DelaysNacks: true}, info)
	}
}

// requireAgain checks the redelivery.Info of a second delivery on queue type qt.
func requireAgain(t *testing.T, qt amqp.QueueType, m *message.Message) {
	t.Helper()
	info := testsvc.Info(t, m)
	if qt == amqp.Quorum {
		require.Equal(t, redelivery.Info{Count: 2, DelaysNacks: true}, info, "message %s", m.UUID)
	} else {
		require.Equal(t, redelivery.Info{Redelivered: true, DelaysNacks: true}, info, "message %s", m.UUID)
	}
}

func TestSubscriber_AckGivenRightBeforeCloseIsNotDeliveredAgain(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const n = 20
		ids := f.publish("m", n)
		s := f.subscriber(f.config(n))
		got := testsvc.ReceiveN(t, f.subscribe(s), n, within)
		var unacked []string
		for i, m := range got {
			if i%2 == 0 {
				ack(m)
			} else {
				unacked = append(unacked, m.UUID)
			}
		}
		require.NoError(t, s.Close()) // right after the acks
		f.eventuallyReady(n / 2)

		next := f.subscribe(f.subscriber(f.config(n)))
		again := testsvc.ReceiveN(t, next, n/2, within)
		require.ElementsMatch(t, unacked, uuids(again), "exactly the unacked half comes again")
		for _, m := range again {
			requireAgain(t, f.topology.Queue.Type, m)
			ack(m)
		}
		testsvc.RequireNothing(t, next, 300*time.Millisecond)
		f.eventuallyReady(0)
		require.Len(t, ids, n)
	})
}

func TestSubscriber_NackAfterComesBackNoSoonerAndCounted(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		f.publish("m", 1)
		msgs := f.subscribe(f.subscriber(f.config(10))) // NackDelay 0: only the router's delay
		first := receive(t, msgs)
		requireFirst(t, f.topology.Queue.Type, first)

		const delay = 500 * time.Millisecond
		nacked := time.Now()
		require.True(t, nackAfter(first, delay))
		select {
		case <-first.Context().Done():
		case <-time.After(within):
			t.Fatal("a nacked message's context is not cancelled")
		}
		again := receive(t, msgs)
		require.GreaterOrEqual(t, time.Since(nacked), delay)
		require.Equal(t, first.UUID, again.UUID)
		require.Equal(t, string(first.Payload), string(again.Payload))
		requireAgain(t, f.topology.Queue.Type, again)
		require.Equal(t, "true", again.Metadata.Get(broker.HeaderAMQPRedelivered))
		ack(again)
		f.eventuallyReady(0)
	})
}

// RabbitMQ 3.10 sets no x-delivery-count on a quorum queue's first delivery of a message, then
// the number of earlier deliveries (returns) on each later one; classic queues never set it.
func TestSubscriber_DeliveryCountOfAQuorumQueueIsXDeliveryCountPlusOne(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		f.publish("m", 1)
		msgs := f.subscribe(f.subscriber(f.config(10)))
		var counts []int
		var headers []string
		var redelivered []bool
		for range 4 {
			m := receive(t, msgs)
			info := testsvc.Info(t, m)
			counts = append(counts, info.Count)
			redelivered = append(redelivered, info.Redelivered)
			h, ok := m.Metadata[amqp.HeaderDeliveryCount]
			if !ok {
				h = "(none)"
			}
			headers = append(headers, h)
			require.True(t, nackAfter(m, 0))
		}
		m := receive(t, msgs)
		ack(m)
		if f.topology.Queue.Type == amqp.Quorum {
			require.Equal(t, []string{"(none)", "1", "2", "3"}, headers)
			require.Equal(t, []int{1, 2, 3, 4}, counts)
			require.Equal(t, []bool{false, false, false, false}, redelivered, "Redelivered is only for Count 0")
			require.Equal(t, 5, testsvc.Info(t, m).Count)
		} else {
			require.Equal(t, []string{"(none)", "(none)", "(none)", "(none)"}, headers)
			require.Equal(t, []int{0, 0, 0, 0}, counts)
			require.Equal(t, []bool{false, true, true, true}, redelivered)
		}
	})
}

func TestSubscriber_HeldNackDoesNotBlockTheMessagesBehindIt(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const goods = 100
		const hold = 3 * time.Second
		poison := f.publish("poison", 1)[0]
		f.publish("good", goods)
		msgs := f.subscribe(f.subscriber(f.config(10)))

		seen := map[string]int{}
		poisonDeliveries := 0
		var nackedAt, goodsDone, poisonBack time.Time
		for len(seen) < goods || poisonDeliveries < 2 {
			m := receive(t, msgs)
			if m.UUID != poison {
				seen[m.UUID]++
				ack(m)
				if len(seen) == goods && goodsDone.IsZero() {
					goodsDone = time.Now()
				}
				continue
			}
			poisonDeliveries++
			if poisonDeliveries == 1 {
				nackedAt = time.Now()
				require.True(t, nackAfter(m, hold))
			} else {
				poisonBack = time.Now()
				ack(m)
			}
		}
		require.Len(t, seen, goods)
		for id, n := range seen {
			require.Equal(t, 1, n, "message %s", id)
		}
		require.True(t, goodsDone.Before(poisonBack), "every good message was acked while the poison one was held")
		require.GreaterOrEqual(t, poisonBack.Sub(nackedAt), hold)
		testsvc.RequireNothing(t, msgs, 300*time.Millisecond)
		f.eventuallyReady(0)
	})
}

func TestSubscriber_CloseGivesBackUnsettledDeliveriesToAnotherConsumer(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		ids := f.publish("m", 3)
		a := f.subscriber(f.config(3))
		held := testsvc.ReceiveN(t, f.subscribe(a), 3, within)
		b := f.subscriber(f.config(3))
		msgsB := f.subscribe(b)
		testsvc.RequireNothing(t, msgsB, 300*time.Millisecond) // a holds them all

		require.NoError(t, a.Close())
		for _, m := range held {
			select {
			case <-m.Context().Done():
			default:
				t.Fatalf("message %s: context not cancelled by Close", m.UUID)
			}
		}
		got := testsvc.ReceiveN(t, msgsB, 3, within)
		require.ElementsMatch(t, ids, uuids(got))
		for _, m := range held {
			ack(m) // too late: a has closed; this changes nothing
		}
		for _, m := range got {
			requireAgain(t, f.topology.Queue.Type, m)
			ack(m)
		}
		f.eventuallyReady(0)
	})
}

func TestSubscriber_CompetingConsumersNeverHoldTheSameMessageAtOnce(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const n = 300
		ids := f.publish("m", n)
		var (
			mu        sync.Mutex
			holding   = map[string]bool{}
			acked     = map[string]int{}
			overlaps  []string
			allAcked  = make(chan struct{})
			consumers sync.WaitGroup
		)
		handle := func(m *message.Message) {
			mu.Lock()
			if holding[m.UUID] {
				overlaps = append(overlaps, m.UUID)
			}
			holding[m.UUID] = true
			mu.Unlock()
			time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond) // processing time
			mu.Lock()
			delete(holding, m.UUID)
			acked[m.UUID]++
			if len(acked) == n {
				close(allAcked)
			}
			mu.Unlock()
			ack(m)
		}
		for range 3 {
			msgs := f.subscribe(f.subscriber(f.config(20)))
			consumers.Go(func() {
				for m := range msgs {
					go handle(m)
				}
			})
		}
		select {
		case <-allAcked:
		case <-time.After(within):
			t.Fatal("not every message was acked")
		}
		f.eventuallyReady(0)
		mu.Lock()
		defer mu.Unlock()
		require.Empty(t, overlaps, "messages held by two consumers at once")
		require.Len(t, acked, n)
		for _, id := range ids {
			require.Equal(t, 1, acked[id], "message %s", id)
		}
	})
}

func TestSubscriber_LostConnectionRedeliversWhatWasInFlightAndGoesOn(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		const n = 10
		px := newProxy(t, f.url)
		cfg := f.config(n)
		cfg.URL = px.url
		cfg.ReconnectInitial = 50 * time.Millisecond
		s := f.subscriber(cfg)
		var frames amqp.FrameCounter
		amqp.CountFrames(s, &frames)
		ids := f.publish("m", n)
		msgs := f.subscribe(s)

		// m-0 and m-1 (tags 1 and 2) are acked and the acks sent; m-2, m-3 and m-4 (tags 3, 4
		// and 5) are in flight when the connection goes.
		first := testsvc.ReceiveN(t, msgs, 5, within)
		require.Equal(t, ids[:5], uuids(first))
		ack(first[0])
		ack(first[1])
		testsvc.Eventually(t, within, func() bool {
			single, multiple, _ := frames.Frames()
			return multiple >= 1 || single >= 2
		}, "the acks of m-0 and m-1 are not sent")
		stale := first[2:]
		px.cut()
		for _, m := range stale {
			select {
			case <-m.Context().Done():
			case <-time.After(within):
				t.Fatalf("message %s: context not cancelled when the connection was lost", m.UUID)
			}
		}
		px.restore(t)

		// The subscription goes on by itself, on a new connection and channel, where the
		// delivery tags start again at 1, in the order the messages arrive.
		again := testsvc.ReceiveN(t, msgs, n-2, within)
		require.ElementsMatch(t, ids[2:], uuids(again))
		byID := map[string]*message.Message{}
		for _, m := range again {
			byID[m.UUID] = m
		}
		for _, m := range stale {
			requireAgain(t, f.topology.Queue.Type, byID[m.UUID])
		}
		// The stale deliveries' acks are dropped. Sent on the new channel, the ack of m-3
		// (tag 4 on the lost channel) would ack the fourth delivery there: keep that one
		// unacked and see that it stays so.
		keep := again[3].UUID
		require.NotEqual(t, stale[1].UUID, keep, "the test needs another message at tag 4")
		for _, m := range stale {
			ack(m)
		}
		for _, m := range again {
			if m.UUID != keep {
				ack(m)
			}
		}
		require.NoError(t, s.Close())
		f.eventuallyReady(1)
		next := f.subscribe(f.subscriber(f.config(n)))
		m := receive(t, next)
		require.Equal(t, keep, m.UUID, "the one message not acked on the new channel")
		ack(m)
		testsvc.RequireNothing(t, next, 300*time.Millisecond)
	})
}

func TestSubscriber_CloseWhileReconnectingReturnsPromptly(t *testing.T) {
	t.Parallel()
	f := setup(t, amqp.Queue{})
	px := newProxy(t, f.url)
	cfg := f.config(10)
	cfg.URL = px.url
	cfg.ReconnectInitial = 20 * time.Millisecond
	cfg.ReconnectMax = 50 * time.Millisecond
	s := f.subscriber(cfg)
	msgs := f.subscribe(s)
	px.cut() // and never restored
	start := time.Now()
	require.NoError(t, s.Close())
	require.Less(t, time.Since(start), 2*time.Second)
	_, open := <-msgs
	require.False(t, open)
}

func TestSubscriber_CloseIsBoundedWhenRabbitMQDoesNotAnswer(t *testing.T) {
	t.Parallel()
	forEachMode(t, "", true, func(t *testing.T, direct bool) {
		f := setup(t, amqp.Queue{})
		f.direct = direct
		px := newProxy(t, f.url)
		cfg := f.config(10)
		cfg.URL = px.url
		cfg.CloseTimeout = 500 * time.Millisecond
		s := f.subscriber(cfg)
		f.publish("m", 1)
		msgs := f.subscribe(s)
		m := receive(t, msgs)
		px.blackhole()
		ack(m)

		start := time.Now()
		err := s.Close()
		elapsed := time.Since(start)
		require.Error(t, err, "an ack may be lost: Close says so")
		require.Less(t, elapsed, cfg.CloseTimeout+1500*time.Millisecond)
		_, open := <-msgs
		require.False(t, open)
	})
}

func TestSubscriber_ContextEndEndsTheSubscriptionOnly(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		ids := f.publish("m", 4)
		s := f.subscriber(f.config(4))
		ctx, cancel := context.WithCancel(f.context())
		msgs, err := s.Subscribe(ctx, f.topic)
		require.NoError(t, err)
		got := testsvc.ReceiveN(t, msgs, 4, within)
		ack(got[0])
		ack(got[1])
		cancel()
		for range msgs { // closed, and nothing more handed out
			t.Fatal("message handed out after the context ended")
		}
		for _, m := range got {
			select {
			case <-m.Context().Done():
			default:
				t.Fatalf("message %s: context not cancelled", m.UUID)
			}
		}
		f.eventuallyReady(2)

		// The Subscriber and its connection go on.
		again := testsvc.ReceiveN(t, f.subscribe(s), 2, within)
		require.ElementsMatch(t, ids[2:], uuids(again))
		for _, m := range again {
			ack(m)
		}
		f.eventuallyReady(0)
	})
}

func TestSubscriber_SubscribeAfterCloseFails(t *testing.T) {
	t.Parallel()
	f := setup(t, amqp.Queue{})
	s := f.subscriber(f.config(1))
	require.NoError(t, s.Close())
	require.NoError(t, s.Close(), "Close is idempotent")
	_, err := s.Subscribe(context.Background(), f.topic)
	require.ErrorIs(t, err, amqp.ErrClosed)
}
