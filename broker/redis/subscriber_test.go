package redis_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestSubscriber_AckGivenBeforeCloseIsSent(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		f.publish(50)
		sub, ch := f.subscribe(redissub.Config{Prefetch: 50})
		for _, m := range testsvc.ReceiveN(t, ch, 50, 10*time.Second) {
			m.Ack()
		}
		require.NoError(t, sub.Close())
		require.Zero(t, f.pendingCount(), "every ack given before Close is in Redis when Close returns")
		_, ok := <-ch
		require.False(t, ok, "the channel is closed")
		consumers, err := f.admin.XInfoConsumers(context.Background(), f.topic, group).Result()
		require.NoError(t, err)
		require.Empty(t, consumers, "a consumer that closes with nothing pending leaves the group")

		sentinel := f.publish(1)[0]
		_, next := f.subscribe(redissub.Config{})
		m := testsvc.Receive(t, next, 10*time.Second)
		require.Equal(t, sentinel.UUID, m.UUID, "no acked entry comes again")
		m.Ack()
	})
}

// countingHook counts the XACK commands a client sends and the ids they carry, and the
// XAUTOCLAIMs, and records the COUNT of each XREADGROUP.
type countingHook struct {
	mu         sync.Mutex
	commands   int
	ids        int
	reads      []int64
	autoclaims int
}

func (h *countingHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *countingHook) count(cmd redis.Cmder) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch cmd.Name() {
	case "xack":
		h.commands++
		h.ids += len(cmd.Args()) - 3
	case "xautoclaim":
		h.autoclaims++
	case "xreadgroup":
		args := cmd.Args()
		for i := range len(args) - 1 {
			if a, ok := args[i].(string); ok && strings.EqualFold(a, "count") {
				h.reads = append(h.reads, args[i+1].(int64))
			}
		}
	}
}

func (h *countingHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h *countingHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.count(c)
		}
		return next(ctx, cmds)
	}
}

func TestSubscriber_AcksGivenTogetherGoInOneXACK(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		const n = 200
		f.publish(n)
		c := f.client(f.url)
		hook := &countingHook{}
		c.AddHook(hook)
		sub, err := redissub.NewSubscriber(c, redissub.Config{ConsumerGroup: group, Prefetch: n})
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		ch, err := f.subscribeWith(context.Background(), sub)
		require.NoError(t, err)

		msgs := testsvc.ReceiveN(t, ch, n, 10*time.Second)
		for _, m := range msgs {
			m.Ack()
		}
		testsvc.Eventually(t, 10*time.Second, func() bool { return f.pendingCount() == 0 }, "entries still pending")
		hook.mu.Lock()
		defer hook.mu.Unlock()
		require.Equal(t, n, hook.ids, "each ack is sent once")
		require.LessOrEqual(t, hook.commands, 5, "%d acks given together took %d XACKs", n, hook.commands)
		t.Logf("%d acks in %d XACK commands", hook.ids, hook.commands)
	})
}

// The subscriptions of one Subscriber to a stream are consumers of one group: one pass over the
// pending entries list per ClaimInterval claims the idle entries for all of them.
func TestSubscriber_SubscriptionsShareTheClaimOfIdleEntries(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		c := f.client(f.url)
		hook := &countingHook{}
		c.AddHook(hook)
		const interval, subscriptions = 50 * time.Millisecond, 4
		sub, err := redissub.NewSubscriber(c, redissub.Config{ConsumerGroup: group, ClaimInterval: interval, BlockTime: 10 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		start := time.Now()
		for range subscriptions {
			_, err := f.subscribeWith(context.Background(), sub)
			require.NoError(t, err)
		}
		time.Sleep(20 * interval) // idle: each pass is one XAUTOCLAIM of an empty list
		require.NoError(t, sub.Close())
		passes := int(time.Since(start)/interval) + 1
		hook.mu.Lock()
		defer hook.mu.Unlock()
		require.NotZero(t, hook.autoclaims)
		require.LessOrEqual(t, hook.autoclaims, passes, "%d subscriptions, %d passes at most: %d XAUTOCLAIMs", subscriptions, passes, hook.autoclaims)
	})
}

func TestSubscriber_NackAfterComesBackNoSoonerThanAskedWithCountPlusOne(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		want := f.publish(1)[0]
		_, ch := f.subscribe(redissub.Config{AckTimeout: 10 * time.Second, NackDelay: 200 * time.Millisecond})

		m := testsvc.Receive(t, ch, 10*time.Second)
		require.Equal(t, 1, testsvc.Info(t, m).Count)
		const asked = 700 * time.Millisecond
		nacked := time.Now()
		require.True(t, redelivery.NackAfter(m, asked))

		again := testsvc.Receive(t, ch, 10*time.Second)
		elapsed := time.Since(nacked)
		require.Equal(t, want.UUID, again.UUID)
		require.Equal(t, string(want.Payload), string(again.Payload))
		require.Equal(t, want.Metadata.Get("i"), again.Metadata.Get("i"))
		require.GreaterOrEqual(t, elapsed, asked)
		require.Less(t, elapsed, 5*time.Second, "the delay brought it back, not the ack timeout")
		require.Equal(t, redelivery.Info{Count: 2, DelaysNacks: true}, testsvc.Info(t, again))

		// A nack without a requested delay waits Config.NackDelay.
		nacked = time.Now()
		again.Nack()
		third := testsvc.Receive(t, ch, 10*time.Second)
		require.GreaterOrEqual(t, time.Since(nacked), 200*time.Millisecond)
		require.Equal(t, 3, testsvc.Info(t, third).Count)
		third.Ack()
	})
}

func TestSubscriber_NackDelayLongerThanAckTimeoutIsKept(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		want := f.publish(1)[0]
		cfg := redissub.Config{AckTimeout: 400 * time.Millisecond}
		_, ch := f.subscribe(cfg)
		_, other := f.subscribe(cfg) // a competitor whose claim passes must not take it early

		var m *message.Message
		select {
		case m = <-ch:
		case m = <-other:
		case <-time.After(10 * time.Second):
			t.Fatal("no delivery")
		}
		const asked = 1500 * time.Millisecond
		nacked := time.Now()
		require.True(t, redelivery.NackAfter(m, asked))
		var again *message.Message
		select {
		case again = <-ch:
		case again = <-other:
		case <-time.After(10 * time.Second):
			t.Fatal("no redelivery")
		}
		require.Equal(t, want.UUID, again.UUID)
		require.GreaterOrEqual(t, time.Since(nacked), asked)
		require.Equal(t, 2, testsvc.Info(t, again).Count)
		again.Ack()
	})
}

func TestSubscriber_CloseGivesBackUnsettledDeliveriesAtOnce(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		msgs := f.publish(5)
		// The default ack timeout, 30 s: the entries come back because Close gives them back.
		subA, chA := f.subscribe(redissub.Config{})
		held := testsvc.ReceiveN(t, chA, 5, 10*time.Second)
		_, chB := f.subscribe(redissub.Config{})
		testsvc.RequireNothing(t, chB, 200*time.Millisecond) // A holds them

		closed := time.Now()
		require.NoError(t, subA.Close())
		for _, m := range held {
			testsvc.RequireDone(t, m.Context(), time.Second, "a delivery of a closed subscriber")
		}
		got := map[string]int{}
		for range msgs {
			m := testsvc.Receive(t, chB, 10*time.Second)
			got[m.UUID] = testsvc.Info(t, m).Count
			m.Ack()
		}
		require.Less(t, time.Since(closed), 5*time.Second)
		for _, m := range msgs {
			require.Equal(t, 2, got[m.UUID], "delivery count of %s", m.UUID)
		}
		held[0].Ack() // after Close: a no-op
		testsvc.Eventually(t, 10*time.Second, func() bool { return f.pendingCount() == 0 }, "entries still pending")
	})
}

func TestSubscriber_CompetingConsumersNeverHoldTheSameEntry(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		const n = 300
		f.publish(n)

		var mu sync.Mutex
		holding := map[string]bool{}
		acked := map[string]int{}
		var overlaps []string
		done := make(chan struct{})
		var wg sync.WaitGroup
		for c := range 3 {
			_, ch := f.subscribe(redissub.Config{Prefetch: 20})
			wg.Go(func() {
				var handlers sync.WaitGroup
				defer handlers.Wait()
				for {
					var m *message.Message
					select {
					case m = <-ch:
					case <-done:
						return
					}
					handlers.Go(func() {
						mu.Lock()
						if holding[m.UUID] {
							overlaps = append(overlaps, m.UUID)
						}
						holding[m.UUID] = true
						mu.Unlock()
						time.Sleep(time.Duration(c) * time.Millisecond) // the consumers differ in speed
						mu.Lock()
						holding[m.UUID] = false
						acked[m.UUID]++
						mu.Unlock()
						m.Ack()
					})
				}
			})
		}
		testsvc.Eventually(t, 30*time.Second, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(acked) == n
		}, "not every entry was acked")
		testsvc.Eventually(t, 10*time.Second, func() bool { return f.pendingCount() == 0 }, "entries still pending")
		close(done)
		wg.Wait()
		require.Empty(t, overlaps, "entries held by two consumers at once")
		for id, k := range acked {
			require.Equal(t, 1, k, "%s acked %d times", id, k)
		}
	})
}

func TestSubscriber_AckTimeoutCancelsTheDeliveryAndALateAckIsDropped(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		msgs := f.publish(1)
		_, ch := f.subscribe(redissub.Config{AckTimeout: 300 * time.Millisecond})

		first := testsvc.Receive(t, ch, 10*time.Second)
		testsvc.RequireDone(t, first.Context(), 5*time.Second, "a delivery past its ack timeout")
		again := testsvc.Receive(t, ch, 10*time.Second) // claimed again, by the same consumer
		require.Equal(t, msgs[0].UUID, again.UUID)
		require.Equal(t, 2, testsvc.Info(t, again).Count)

		first.Ack() // dropped: it would settle the entry that again holds
		sentinel := f.publish(1)[0]
		m := testsvc.Receive(t, ch, 10*time.Second)
		require.Equal(t, sentinel.UUID, m.UUID)
		m.Ack() // acks are sent in order: once this one is in, the late one was not sent
		testsvc.Eventually(t, 10*time.Second, func() bool { return f.pendingCount() == 1 }, "the sentinel's ack is not in Redis")
		require.EqualValues(t, 2, f.pendingOf(msgs[0].UUID).RetryCount)
		again.Ack()
	})
}

func TestSubscriber_LostConnectionRedeliversWhatWasInFlightAndGoesOn(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		px := f.proxy()
		msgs := f.publish(5)
		sub := f.subscriber(px.url, redissub.Config{})
		ch, err := f.subscribeWith(context.Background(), sub)
		require.NoError(t, err)
		held := testsvc.ReceiveN(t, ch, 5, 10*time.Second)

		px.cut()
		for _, m := range held {
			testsvc.RequireDone(t, m.Context(), 5*time.Second, "a delivery in flight at a lost connection")
		}
		px.restore(t)

		// Given back on reconnection, not after the 30 s ack timeout.
		got := map[string]int{}
		for range msgs {
			m := testsvc.Receive(t, ch, 10*time.Second)
			got[m.UUID] = testsvc.Info(t, m).Count
			m.Ack()
		}
		for _, m := range msgs {
			require.Equal(t, 2, got[m.UUID], "delivery count of %s", m.UUID)
		}
		later := f.publish(3)
		for _, want := range later {
			m := testsvc.Receive(t, ch, 10*time.Second)
			require.Equal(t, want.UUID, m.UUID)
			require.Equal(t, 1, testsvc.Info(t, m).Count)
			m.Ack()
		}
		testsvc.Eventually(t, 10*time.Second, func() bool { return f.pendingCount() == 0 }, "entries still pending")
	})
}

func TestSubscriber_CloseReturnsInTimeWhenRedisIsGoneAndReportsUnsentAcks(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		px := f.proxy()
		f.publish(3)
		sub := f.subscriber(px.url, redissub.Config{CloseTimeout: time.Second})
		ch, err := f.subscribeWith(context.Background(), sub)
		require.NoError(t, err)
		held := testsvc.ReceiveN(t, ch, 3, 10*time.Second)

		px.cut()
		held[0].Ack()
		start := time.Now()
		err = sub.Close()
		require.Less(t, time.Since(start), 3*time.Second)
		// The ack went in before the subscription noticed the loss, or was refused after it:
		// either way Close says so if it could not send it.
		if err != nil {
			require.ErrorContains(t, err, "1 acks of stream")
		}
		_, ok := <-ch
		require.False(t, ok)
		require.Equal(t, err, sub.Close(), "Close is idempotent: again, the first call's result")
	})
}

func TestSubscriber_StreamDeletedUnderASubscriptionIsCreatedAgain(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		f.publish(1)
		_, ch := f.subscribe(redissub.Config{})
		testsvc.Receive(t, ch, 10*time.Second).Ack()
		require.NoError(t, f.admin.Del(context.Background(), f.topic).Err())

		testsvc.Eventually(t, 10*time.Second, func() bool {
			n, err := f.admin.Exists(context.Background(), f.topic).Result()
			return err == nil && n == 1
		}, "the stream was not created again")
		want := f.publish(1)[0]
		m := testsvc.Receive(t, ch, 10*time.Second)
		require.Equal(t, want.UUID, m.UUID)
		m.Ack()
	})
}

func TestSubscriber_SubscriptionEndsWithItsContext(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		f.publish(2)
		sub := f.subscriber(f.url, redissub.Config{})
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := f.subscribeWith(ctx, sub)
		require.NoError(t, err)
		held := testsvc.ReceiveN(t, ch, 2, 10*time.Second)
		held[0].Ack()
		cancel()
		for range ch { // closed once the subscription has ended
		}
		require.EqualValues(t, 1, f.pendingCount(), "the ack was sent, the other entry given back")

		_, next := f.subscribe(redissub.Config{})
		m := testsvc.Receive(t, next, 10*time.Second)
		require.Equal(t, held[1].UUID, m.UUID)
		require.Equal(t, 2, testsvc.Info(t, m).Count)
		m.Ack()
	})
}

// Each subscription reads on a connection of its own while they take at most half of the
// client's pool; the others read on the pool.
func TestSubscriber_MoreSubscriptionsThanThePoolHasConnections(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		const subscriptions, n = 6, 60
		f.publish(n)
		opts, err := redis.ParseURL(f.url)
		require.NoError(t, err)
		opts.MaxRetries, opts.PoolSize = -1, 4
		c := redis.NewClient(opts)
		t.Cleanup(func() { _ = c.Close() })
		sub, err := redissub.NewSubscriber(c, redissub.Config{ConsumerGroup: group, Prefetch: 5})
		require.NoError(t, err)
		got := make(chan *message.Message, n)
		for range subscriptions {
			ch, err := f.subscribeWith(context.Background(), sub)
			require.NoError(t, err)
			go func() {
				for m := range ch {
					testsvc.Ack(m) // settled before the test counts it, as the router settles
					got <- m
				}
			}()
		}
		seen := map[string]bool{}
		for range n {
			m := testsvc.Receive(t, got, 10*time.Second)
			require.False(t, seen[m.UUID], "%s delivered twice", m.UUID)
			seen[m.UUID] = true
		}
		start := time.Now()
		require.NoError(t, sub.Close())
		require.Less(t, time.Since(start), 2*time.Second)
		require.Zero(t, f.pendingCount())
	})
}

func TestSubscriber_ClosedSubscriberRefusesSubscribe(t *testing.T) {
	t.Parallel()
	f := setup(t)
	sub := f.subscriber(f.url, redissub.Config{})
	require.NoError(t, sub.Close())
	_, err := sub.Subscribe(context.Background(), f.topic)
	require.ErrorIs(t, err, redissub.ErrClosed)
}

func TestConfig_Validate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  redissub.Config
		want string
	}{
		{redissub.Config{}, "ConsumerGroup is empty"},
		{redissub.Config{ConsumerGroup: "g", Prefetch: -1}, "Config.Prefetch: -1"},
		{redissub.Config{ConsumerGroup: "g", NackDelay: -2}, "Config.NackDelay: -2ns"},
		{redissub.Config{ConsumerGroup: "g", AckTimeout: time.Millisecond}, "Config.AckTimeout: 1ms is shorter than 10ms"},
		{redissub.Config{ConsumerGroup: "g", BlockTime: -time.Second}, "Config.BlockTime: -1s is negative"},
	} {
		require.ErrorContains(t, tc.cfg.Validate(), tc.want)
	}
	require.NoError(t, redissub.Config{ConsumerGroup: "g", NackDelay: broker.NoNackDelay}.Validate())
}
