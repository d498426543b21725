package testsvc

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// Settler makes a test written for any consumer run as one that settles each message itself
// (redelivery.WithDirectSettle), as onceflow's router does: it passes on the messages of such a
// subscription and settles each (redelivery.Settle) as soon as the test acks or nacks it. It
// settles from a goroutine of its own, a moment after the ack; a test of the direct mode itself
// calls Settle right after the ack, in the goroutine that gave it. The zero value is ready to
// use.
type Settler struct {
	passing sync.WaitGroup
}

// Settling returns a channel with the messages of ch, a subscription made with
// redelivery.WithDirectSettle, each settled once the test acks or nacks it. A message whose
// context ends before the test takes it is not passed on, as a subscriber does not hand out a
// delivery that has ended. The channel closes after ch; Settling stops when the test ends.
func (s *Settler) Settling(t testing.TB, ch <-chan *message.Message) <-chan *message.Message {
	out := make(chan *message.Message)
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	s.passing.Add(1)
	go func() {
		defer s.passing.Done()
		defer close(out)
		for m := range ch {
			go func() {
				select {
				case <-m.Acked():
				case <-m.Nacked():
				case <-done:
					return
				}
				redelivery.Settle(m)
			}()
			select {
			case out <- m:
			case <-m.Context().Done():
			case <-done:
				return
			}
		}
	}()
	return out
}

// Wait waits until the channels that Settling returned are closed: after the subscriber's
// Close, so that they are closed when Close returns, as the subscriber's own are.
func (s *Settler) Wait() { s.passing.Wait() }

// SettlingSubscriber subscribes as a consumer that settles directly, for consumers (watermill's
// universal suite) that only ack and nack: it calls redelivery.Settle after each message's ack or nack, as the
// router does, from a goroutine per message that waits for it until the subscription ends.
type SettlingSubscriber struct {
	message.Subscriber
	closed    chan struct{}
	closeOnce sync.Once
	// passing counts the subscriptions whose channels are not closed yet.
	passing sync.WaitGroup
}

// NewSettlingSubscriber returns sub as a consumer that settles directly.
func NewSettlingSubscriber(sub message.Subscriber) *SettlingSubscriber {
	return &SettlingSubscriber{Subscriber: sub, closed: make(chan struct{})}
}

// Close closes the subscriber; a message that waits to be handed out is then dropped (its
// broker delivers it again), and the subscriptions' channels are closed when it returns, as
// the subscriber's own are.
func (s *SettlingSubscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closed) })
	err := s.Subscriber.Close()
	s.passing.Wait()
	return err
}

// SubscribeInitialize passes the call on, if the Subscriber has the method.
func (s *SettlingSubscriber) SubscribeInitialize(topic string) error {
	if i, ok := s.Subscriber.(message.SubscribeInitializer); ok {
		return i.SubscribeInitialize(topic)
	}
	return nil
}

// Subscribe subscribes with redelivery.WithDirectSettle and settles each message of the
// subscription once it is acked or nacked.
func (s *SettlingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(redelivery.WithDirectSettle(ctx), topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	ended := make(chan struct{})
	s.passing.Add(1)
	go func() {
		defer s.passing.Done()
		defer close(out)
		defer close(ended)
		for m := range in {
			go func() {
				select {
				case <-m.Acked():
				case <-m.Nacked():
				case <-ended:
					select {
					case <-m.Acked():
					case <-m.Nacked():
					default:
						return // never settled
					}
				}
				redelivery.Settle(m)
			}()
			select {
			case out <- m:
			case <-s.closed:
			case <-m.Context().Done():
				// Its delivery ended before the consumer took it: the broker gives it back.
			}
		}
	}()
	return out, nil
}

// ForEachSettleMode runs test as a parallel subtest with a consumer that settles each message
// itself (redelivery.WithDirectSettle, as onceflow's router does; "<prefix>direct") and, when
// watched is true, with one that only acks and nacks, whose settlements the subscriber watches
// for ("<prefix>watched").
func ForEachSettleMode(t *testing.T, prefix string, watched bool, test func(t *testing.T, direct bool)) {
	t.Helper()
	modes := []bool{true}
	if watched {
		modes = append(modes, false)
	}
	for _, direct := range modes {
		name := prefix + "watched"
		if direct {
			name = prefix + "direct"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, direct)
		})
	}
}

// Ack acks m and settles it, as the router does: redelivery.Settle tells a subscription whose
// consumer settles directly, and does nothing for any other.
func Ack(m *message.Message) {
	m.Ack()
	redelivery.Settle(m)
}

// Nack nacks m and settles it, as Ack.
func Nack(m *message.Message) {
	m.Nack()
	redelivery.Settle(m)
}

// NackAfter nacks m with redelivery.NackAfter and settles it, as Ack.
func NackAfter(m *message.Message, d time.Duration) bool {
	ok := redelivery.NackAfter(m, d)
	redelivery.Settle(m)
	return ok
}
