package broker

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/redact"
)

// subscriber is the Subscriber a Broker hands out: the scheme's own (Backend.NewSubscriber),
// with the Broker's topic check, errors without the URL's password, and a Close that is
// idempotent and safe to call concurrently.
type subscriber struct {
	b      *Broker
	up     message.Subscriber
	closed atomic.Bool // set when Close begins

	closeOnce sync.Once
	closeErr  error
}

var _ message.Subscriber = (*subscriber)(nil)

// MessagingSystem returns the messaging.system of the subscriber's broker (see
// Broker.MessagingSystem); the router reads it for its spans and metrics.
func (s *subscriber) MessagingSystem() string { return s.b.MessagingSystem() }

// ConsumerGroup returns the consumer group of the subscriber's subscriptions; the router reads
// it for its spans and metrics.
func (s *subscriber) ConsumerGroup() string { return s.b.ConsumerGroup() }

// AcksInTransaction reports whether the scheme's subscriber gives its messages a
// redelivery.TxAck, so that a handler can acknowledge them in its own transaction (the
// PostgreSQL and MySQL queues).
func (s *subscriber) AcksInTransaction() bool {
	a, ok := s.up.(interface{ AcksInTransaction() bool })
	return ok && a.AcksInTransaction()
}

// Subscribe starts one competing consumer of topic. The scheme's subscription is handed out as
// it is: it ends when ctx ends or the Subscriber closes, and settles what it has handed out as
// its package documents.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.b.checkTopic(topic); err != nil {
		return nil, err
	}
	if s.closed.Load() {
		return nil, ErrClosed
	}
	in, err := s.up.Subscribe(ctx, topic)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("broker: subscribe to %q on %s: %w", topic, s.b.redacted, err), s.b.secrets)
	}
	return in, nil
}

// Close ends the subscriptions and closes the scheme's subscriber. Messages a consumer held
// without acknowledging them are delivered again. Close is idempotent; concurrent calls all
// return when the first one is done, with its result.
func (s *subscriber) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		err := s.up.Close()
		s.b.life.Remove(s)
		if err != nil {
			s.closeErr = redact.Error(fmt.Errorf("broker: close subscriber of %s: %w", s.b.redacted, err), s.b.secrets)
		}
	})
	return s.closeErr
}
