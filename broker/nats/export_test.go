package nats

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// CreateAttempts is how many times a subscription tries to create its group's consumer.
const CreateAttempts = createAttempts

// WrapJetStream makes s call the JetStream API through wrap(its own).
func WrapJetStream(s *Subscriber, wrap func(jetstream.JetStream) jetstream.JetStream) {
	s.js = wrap(s.js)
}

// SetFillWait sets, until t ends, how long free room in a subscription's window waits to grow
// to half the window before it is asked for anyway. Tests that call it must not run in
// parallel: the wait is the package's.
func SetFillWait(t testing.TB, d time.Duration) {
	old := fillWait
	fillWait = d
	t.Cleanup(func() { fillWait = old })
}
