package nats_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestConfig_ValidateNamesTheField(t *testing.T) {
	t.Parallel()
	ok := natsbroker.Config{URL: "nats://127.0.0.1:4222", ConsumerGroup: "g"}
	require.NoError(t, ok.Validate())
	for field, c := range map[string]natsbroker.Config{
		"Config.URL":           {ConsumerGroup: "g"},
		"Config.ConsumerGroup": {URL: ok.URL},
		"Config.Prefetch":      {URL: ok.URL, ConsumerGroup: "g", Prefetch: -1},
		"Config.AckWait":       {URL: ok.URL, ConsumerGroup: "g", AckWait: -time.Second},
		"Config.NackDelay":     {URL: ok.URL, ConsumerGroup: "g", NackDelay: -time.Second},
		"Config.CloseTimeout":  {URL: ok.URL, ConsumerGroup: "g", CloseTimeout: -time.Second},
	} {
		require.ErrorContains(t, c.Validate(), field)
		_, err := natsbroker.NewSubscriber(c)
		require.ErrorContains(t, err, field)
	}
}

func TestSubscriber_AckRightBeforeCloseIsNotRedelivered(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		const n = 50
		f.publish(0, n)
		s := f.subscriber(natsbroker.Config{Prefetch: n})
		ch := f.subscribe(s)
		var got []*message.Message
		for range n {
			got = append(got, testsvc.Receive(t, ch, within))
		}
		for _, m := range got {
			m.Ack()
		}
		require.NoError(t, s.Close())
		_, open := <-ch
		require.False(t, open, "channel closed by Close")

		sentinel := f.publish(n, n+1)
		next := f.subscribe(f.subscriber(natsbroker.Config{}))
		m := testsvc.Receive(t, next, within)
		require.Equal(t, sentinel[0], m.UUID, "none of the %d messages acked before Close came back", n)
		m.Ack()
	})
}

func TestSubscriber_NackAfterComesBackNoSoonerThanTheDelayWithCountPlusOne(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		ids := f.publish(0, 2)
		ch := f.subscribe(f.subscriber(natsbroker.Config{NackDelay: 300 * time.Millisecond}))

		m := testsvc.Receive(t, ch, within)
		require.Equal(t, ids[0], m.UUID)
		const delay = 700 * time.Millisecond
		nacked := time.Now()
		require.True(t, redelivery.NackAfter(m, delay), "the subscriber delays nacks")
		testsvc.RequireCause(t, m, context.Canceled, within)

		other := testsvc.Receive(t, ch, within)
		require.Equal(t, ids[1], other.UUID, "the nacked message does not hold the next one back")
		other.Ack()

		again := testsvc.Receive(t, ch, within)
		require.Equal(t, ids[0], again.UUID)
		require.GreaterOrEqual(t, time.Since(nacked), delay)
		require.Equal(t, 2, testsvc.Info(t, again).Count)

		// A plain Nack waits for Config.NackDelay.
		nacked = time.Now()
		again.Nack()
		third := testsvc.Receive(t, ch, within)
		require.Equal(t, ids[0], third.UUID)
		require.GreaterOrEqual(t, time.Since(nacked), 300*time.Millisecond)
		require.Equal(t, 3, testsvc.Info(t, third).Count)
		third.Ack()
	})
}

func TestSubscriber_CloseGivesBackUnsettledDeliveries(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		const n = 5
		ids := f.publish(0, n)
		// AckWait is far longer than the test may take: what comes back comes back because
		// Close gave it back.
		cfg := natsbroker.Config{Prefetch: n, AckWait: time.Minute}
		a := f.subscriber(cfg)
		chA := f.subscribe(a)
		for i := range n {
			require.Equal(t, ids[i], testsvc.Receive(t, chA, within).UUID)
		}
		chB := f.subscribe(f.subscriber(cfg))
		testsvc.RequireOpenAndNothing(t, chB, 300*time.Millisecond) // A holds them all

		require.NoError(t, a.Close())
		seen := map[string]bool{}
		for range n {
			m := testsvc.Receive(t, chB, 10*time.Second)
			require.Equal(t, 2, testsvc.Info(t, m).Count)
			seen[m.UUID] = true
			m.Ack()
		}
		require.Len(t, seen, n)
	})
}

// The messages given back come again counted: the subscription's pull request, which still
// waited at the server for more, is withdrawn before (NATS server 2.9 would deliver a message
// given back while the request lies there as a first delivery again).
func TestSubscriber_SubscriptionEndsWithItsContextAndGivesBack(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		ids := f.publish(0, 3)
		s := f.subscriber(natsbroker.Config{AckWait: time.Minute})
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := f.subscribeWith(ctx, s)
		require.NoError(t, err)
		held := testsvc.Receive(t, ch, within)
		require.Equal(t, ids[0], held.UUID)
		cancel()
		testsvc.RequireCause(t, held, context.Canceled, within)
		for range ch { // the channel closes; deliveries not taken are given back
		}

		// The Subscriber goes on serving other subscriptions.
		next := f.subscribe(s)
		counts := map[string]int{}
		for range 3 {
			m := testsvc.Receive(t, next, 10*time.Second)
			_, seen := counts[m.UUID]
			require.False(t, seen, "message %s delivered twice", m.UUID)
			counts[m.UUID] = testsvc.Info(t, m).Count
			m.Ack()
		}
		require.Equal(t, map[string]int{ids[0]: 2, ids[1]: 2, ids[2]: 2}, counts, "delivery counts")
	})
}

func TestSubscriber_CompetingConsumersNeverHoldTheSameMessageAtOnce(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		const n, consumers = 300, 3
		f.publish(0, n)

		var mu sync.Mutex
		held := map[string]bool{}
		acked := map[string]bool{}
		overlap := ""
		done := make(chan struct{})
		consume := func(ch <-chan *message.Message) {
			i := 0
			for m := range ch {
				mu.Lock()
				if held[m.UUID] && overlap == "" {
					overlap = m.UUID
				}
				held[m.UUID] = true
				mu.Unlock()
				i++
				go func(m *message.Message, work time.Duration, nack bool) {
					time.Sleep(work) // a handler at work
					mu.Lock()
					delete(held, m.UUID)
					if !nack {
						acked[m.UUID] = true
						if len(acked) == n {
							close(done)
						}
					}
					mu.Unlock()
					if nack {
						m.Nack()
					} else {
						m.Ack()
					}
				}(m, time.Duration(i%5)*time.Millisecond, i%7 == 0)
			}
		}
		for range consumers {
			go consume(f.subscribe(f.subscriber(natsbroker.Config{Prefetch: 10})))
		}
		select {
		case <-done:
		case <-time.After(within):
			mu.Lock()
			defer mu.Unlock()
			t.Fatalf("%d of %d messages acked", len(acked), n)
		}
		mu.Lock()
		defer mu.Unlock()
		require.Empty(t, overlap, "a message was delivered while another consumer held it")
		require.Len(t, acked, n)
	})
}

func TestSubscriber_ContextEndsWhenAckWaitPassesAndItsLateAckIsIgnored(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		id := f.publish(0, 1)[0]
		ch := f.subscribe(f.subscriber(natsbroker.Config{AckWait: time.Second}))
		first := testsvc.Receive(t, ch, within)
		testsvc.RequireCause(t, first, natsbroker.ErrAckWaitPassed, 5*time.Second)

		second := testsvc.Receive(t, ch, within)
		require.Equal(t, id, second.UUID)
		require.Equal(t, 2, testsvc.Info(t, second).Count)
		first.Ack() // its delivery has ended: ignored
		testsvc.RequireCause(t, second, natsbroker.ErrAckWaitPassed, 5*time.Second)
		third := testsvc.Receive(t, ch, within)
		require.Equal(t, id, third.UUID, "the late ack of the first delivery settled nothing")
		require.GreaterOrEqual(t, testsvc.Info(t, third).Count, 3)
		third.Ack()
	})
}

func TestSubscriber_SubscribeSetsAckWaitOnTheGroupsConsumer(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		id := f.publish(0, 1)[0]
		first := f.subscriber(natsbroker.Config{AckWait: time.Minute})
		m := testsvc.Receive(t, f.subscribe(first), within)
		require.NoError(t, first.Close()) // gives m back

		// A later subscriber of the group with another AckWait sets it on the group's consumer.
		ch := f.subscribe(f.subscriber(natsbroker.Config{AckWait: time.Second}))
		m = testsvc.Receive(t, ch, within)
		require.Equal(t, id, m.UUID)
		require.Equal(t, 2, testsvc.Info(t, m).Count)
		require.Equal(t, time.Second, f.consumerInfo().Config.AckWait)
		testsvc.RequireCause(t, m, natsbroker.ErrAckWaitPassed, 5*time.Second)
		again := testsvc.Receive(t, ch, 5*time.Second) // not after a minute: the server's AckWait is the subscriber's
		require.Equal(t, id, again.UUID)
		// Its count is not checked: NATS 2.9 reports 1 for a message redelivered after its
		// consumer was updated, in about one run in eight (nats-server #5305). The counts of
		// redeliveries are checked by TestSubscriber_ContextEndsWhenAckWaitPassesAndItsLateAckIsIgnored.
		again.Ack()
	})
}

// Subscribers that nack every message and close while redeliveries stream in, one after the
// other, leave the delivery counts right and nothing behind: every message comes to the next
// subscriber at once (not after AckWait), and its count only grows, by one at least for each
// delivery seen (more for those a closing subscriber gave back unseen). On NATS
// server 2.9, a redelivery at a moment when the only pull request waiting has lost its listener
// would be lost until AckWait and roll the consumer back (see fetch).
func TestSubscriber_DeliveryCountsHoldThroughNacksAndCloses(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		const n, rounds, nacks = 50, 3, 100
		f.publish(0, n)
		last := map[string]int{} // the count of each message's last delivery seen
		for range rounds {
			s := f.subscriber(natsbroker.Config{})
			ch := f.subscribe(s)
			for range nacks {
				m := testsvc.Receive(t, ch, within)
				count := testsvc.Info(t, m).Count
				require.Greater(t, count, last[m.UUID], "delivery count of %s", m.UUID)
				last[m.UUID] = count
				m.Nack()
			}
			require.NoError(t, s.Close())
		}
		ch := f.subscribe(f.subscriber(natsbroker.Config{}))
		deadline := time.After(10 * time.Second) // AckWait is 30 s
		acked := map[string]bool{}
		for len(acked) < n {
			select {
			case m := <-ch:
				require.False(t, acked[m.UUID], "message %s delivered again after its ack", m.UUID)
				require.Greater(t, testsvc.Info(t, m).Count, last[m.UUID], "delivery count of %s", m.UUID)
				acked[m.UUID] = true
				m.Ack()
			case <-deadline:
				t.Fatalf("%d of %d messages came back before AckWait", len(acked), n)
			}
		}
		require.Equal(t, uint64(n), f.consumerInfo().Delivered.Stream, "the consumer's position")
	})
}

// refusingJetStream refuses the first refusals consumer creates as the server refuses one on a
// stream whose storage it is still creating, and counts the creates.
type refusingJetStream struct {
	jetstream.JetStream
	mu       sync.Mutex
	refusals int
	creates  int
}

func (js *refusingJetStream) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	js.mu.Lock()
	js.creates++
	refuse := js.creates <= js.refusals
	js.mu.Unlock()
	if refuse {
		return nil, &jetstream.APIError{Code: 500, ErrorCode: jetstream.JSErrCodeConsumerCreate, Description: "invalid stream"}
	}
	return js.JetStream.CreateConsumer(ctx, stream, cfg)
}

// Subscribers of a new topic that start together may ask for the group's consumer while the
// server still creates the stream, which it then refuses with "invalid stream": the
// subscription tries again a bounded number of times, then fails with the server's error.
func TestSubscriber_ConsumerRefusedWhileTheStreamIsCreatedIsCreatedAgain(t *testing.T) {
	t.Parallel()
	f := setup(t)
	id := f.publish(0, 1)[0]

	s := f.subscriber(natsbroker.Config{})
	refusing := &refusingJetStream{refusals: natsbroker.CreateAttempts - 1}
	natsbroker.WrapJetStream(s, func(js jetstream.JetStream) jetstream.JetStream { refusing.JetStream = js; return refusing })
	m := testsvc.Receive(t, f.subscribe(s), within)
	require.Equal(t, id, m.UUID)
	m.Ack()
	require.Equal(t, natsbroker.CreateAttempts, refusing.creates)

	other := f.subscriber(natsbroker.Config{ConsumerGroup: testsvc.UniqueName("g")})
	always := &refusingJetStream{refusals: 1 << 30}
	natsbroker.WrapJetStream(other, func(js jetstream.JetStream) jetstream.JetStream { always.JetStream = js; return always })
	_, err := other.Subscribe(context.Background(), f.topic)
	require.ErrorContains(t, err, "invalid stream")
	require.Equal(t, natsbroker.CreateAttempts, always.creates)
}
