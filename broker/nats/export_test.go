package nats

import (
	"github.com/nats-io/nats.go/jetstream"
)

// CreateAttempts is how many times a subscription tries to create its group's consumer.
const CreateAttempts = createAttempts

// WrapJetStream makes s call the JetStream API through wrap(its own).
func WrapJetStream(s *Subscriber, wrap func(jetstream.JetStream) jetstream.JetStream) {
	s.js = wrap(s.js)
}
