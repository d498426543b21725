package nats

import (
	"sync"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// CreateAttempts is how many times a subscription tries to create its group's consumer.
const CreateAttempts = createAttempts

// WrapJetStream makes s call the JetStream API through wrap(its own).
func WrapJetStream(s *Subscriber, wrap func(jetstream.JetStream) jetstream.JetStream) {
	s.js = wrap(s.js)
}

// LosePullEnds makes the subscriptions ignore the server's end of the next n pull requests
// that end (expired, or no messages), as if the server had dropped them without a word, until
// t ends; each one ignored is signalled on the channel returned. Tests that call it must not
// run in parallel.
func LosePullEnds(t testing.TB, n int) <-chan struct{} {
	lost := make(chan struct{}, n)
	var mu sync.Mutex
	loseEnd = func() bool {
		mu.Lock()
		defer mu.Unlock()
		if n == 0 {
			return false
		}
		n--
		lost <- struct{}{}
		return true
	}
	t.Cleanup(func() { loseEnd = nil })
	return lost
}
