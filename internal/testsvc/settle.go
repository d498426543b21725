package testsvc

import (
	"sync"
	"testing"

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
