package mem_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/mem"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestPubSub runs watermill's universal Pub/Sub suite against the hub. Every constructor call
// of one test shares that test's hub, as the clients of one broker do.
//
// Features:
//   - ExactlyOnceDelivery is false: a subscription that ends gives back what it held, which is
//     delivered again, and an ack racing the end may be lost (at-least-once).
//   - GuaranteedOrder is false: a subscription keeps several deliveries in flight, and a nacked
//     message comes back behind the ones published after it.
//   - NewSubscriberReceivesOldMessages is false: a new subscriber of a group starts where the
//     group is; only a new group reads the topic from its start.
func TestPubSub(t *testing.T) {
	var hubs sync.Map
	hubOf := func(t *testing.T) *mem.Hub {
		h, _ := hubs.LoadOrStore(t, mem.NewHub())
		return h.(*mem.Hub)
	}
	withGroup := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		h := hubOf(t)
		sub, err := mem.NewSubscriber(h, mem.Config{ConsumerGroup: group})
		require.NoError(t, err)
		return publisher{h}, sub
	}
	testsvc.PubSub(t, "", withGroup)
}

type publisher struct{ h *mem.Hub }

func (p publisher) Publish(topic string, msgs ...*message.Message) error {
	return p.h.Publish(topic, msgs...)
}
func (publisher) Close() error { return nil }

func publish(t *testing.T, h *mem.Hub, topic string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		require.NoError(t, h.Publish(topic, message.NewMessage(id, []byte(id))))
	}
}

func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	return testsvc.Receive(t, ch, 5*time.Second)
}

// subscribe starts a subscription to topic "t" of a new Subscriber of h; the caller closes it.
func subscribe(t *testing.T, h *mem.Hub, cfg mem.Config) (*mem.Subscriber, <-chan *message.Message) {
	t.Helper()
	sub, err := mem.NewSubscriber(h, cfg)
	require.NoError(t, err)
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	return sub, ch
}

func TestSubscription_NackComesBackAfterTheRequestedDelayCountedAndDoesNotBlock(t *testing.T) {
	h := mem.NewHub()
	sub, ch := subscribe(t, h, mem.Config{ConsumerGroup: "g", Prefetch: 2})
	defer sub.Close()
	publish(t, h, "t", "poison")
	first := receive(t, ch)
	info, ok := redelivery.FromContext(first.Context())
	require.True(t, ok)
	require.Equal(t, redelivery.Info{Count: 1, DelaysNacks: true}, info)
	start := time.Now()
	require.True(t, redelivery.NackAfter(first, 300*time.Millisecond))

	publish(t, h, "t", "g1", "g2", "g3")
	for _, want := range []string{"g1", "g2", "g3"} {
		m := receive(t, ch)
		require.Equal(t, want, m.UUID)
		m.Ack()
	}
	again := receive(t, ch)
	require.Equal(t, "poison", again.UUID)
	require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
	info, _ = redelivery.FromContext(again.Context())
	require.Equal(t, 2, info.Count)
}

func TestSubscriber_CloseGivesBackWhatItHeldAndKeepsItsAcks(t *testing.T) {
	h := mem.NewHub()
	first, ch := subscribe(t, h, mem.Config{ConsumerGroup: "g", Prefetch: 4})
	publish(t, h, "t", "a", "b", "c")
	a, b := receive(t, ch), receive(t, ch)
	_ = receive(t, ch)
	a.Ack()
	b.Nack()
	require.NoError(t, first.Close())

	second, ch2 := subscribe(t, h, mem.Config{ConsumerGroup: "g"})
	defer second.Close()
	counts := map[string]int{}
	for range 2 {
		m := receive(t, ch2)
		info, _ := redelivery.FromContext(m.Context())
		counts[m.UUID] = info.Count
	}
	testsvc.RequireOpenAndNothing(t, ch2, 50*time.Millisecond)
	require.Equal(t, map[string]int{"b": 2, "c": 2}, counts, "the acked one is not back")
}

func TestSubscriber_CloseLeavesADelayedNackToItsDelay(t *testing.T) {
	h := mem.NewHub()
	first, ch := subscribe(t, h, mem.Config{ConsumerGroup: "g"})
	publish(t, h, "t", "m")
	start := time.Now()
	require.True(t, redelivery.NackAfter(receive(t, ch), 300*time.Millisecond))
	require.NoError(t, first.Close())

	second, ch2 := subscribe(t, h, mem.Config{ConsumerGroup: "g"})
	defer second.Close()
	again := receive(t, ch2)
	require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond, "the nack's delay outlives its subscription")
	info, _ := redelivery.FromContext(again.Context())
	require.Equal(t, "m", again.UUID)
	require.Equal(t, 2, info.Count)
	testsvc.RequireOpenAndNothing(t, ch2, 50*time.Millisecond)
}

func TestGroups_EachGetsEveryMessageAndItsConsumersCompete(t *testing.T) {
	h := mem.NewHub()
	publish(t, h, "t", "m1", "m2", "m3", "m4", "m5", "m6")
	var mu sync.Mutex
	seen := map[string][]string{}
	var wg sync.WaitGroup
	for _, group := range []string{"x", "y"} {
		for i := range 2 {
			sub, err := mem.NewSubscriber(h, mem.Config{ConsumerGroup: group})
			require.NoError(t, err)
			defer sub.Close()
			ch, err := sub.Subscribe(context.Background(), "t")
			require.NoError(t, err)
			wg.Go(func() {
				for {
					select {
					case m := <-ch:
						mu.Lock()
						seen[group] = append(seen[group], fmt.Sprintf("%s@%d", m.UUID, i))
						mu.Unlock()
						m.Ack()
					case <-time.After(200 * time.Millisecond):
						return
					}
				}
			})
		}
	}
	wg.Wait()
	for _, group := range []string{"x", "y"} {
		ids := map[string]bool{}
		for _, s := range seen[group] {
			ids[s[:2]] = true
		}
		require.Len(t, seen[group], 6, group)
		require.Len(t, ids, 6, "group %s got each message once", group)
	}
}
