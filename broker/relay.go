package broker

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/redact"
)

// publisher is the Broker's shared message.Publisher.
type publisher struct {
	b *Broker
}

var _ message.Publisher = (*publisher)(nil)

// Publish checks the topic, prepares it if the scheme needs that, and publishes messages with
// the upstream publisher.
func (p *publisher) Publish(topic string, messages ...*message.Message) error {
	b := p.b
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return ErrClosed
	}
	b.inflight.Add(1)
	b.mu.Unlock()
	defer b.inflight.Done()

	if err := b.checkTopic(topic); err != nil {
		return err
	}
	for i, m := range messages {
		if m == nil {
			return fmt.Errorf("broker: publish to %q: message %d of %d is nil", topic, i+1, len(messages))
		}
		if b.be.checkMessage != nil {
			if err := b.be.checkMessage(m); err != nil {
				return fmt.Errorf("broker: publish to %q: message %d of %d: %w", topic, i+1, len(messages), err)
			}
		}
	}
	if b.be.preparePublish != nil {
		if err := b.be.preparePublish(topic); err != nil {
			return redact.Error(fmt.Errorf("broker: prepare topic %q on %s: %w", topic, b.redacted, err), b.secrets)
		}
	}
	if err := b.be.pub.Publish(topic, messages...); err != nil {
		return redact.Error(fmt.Errorf("broker: publish to %q on %s: %w", topic, b.redacted, err), b.secrets)
	}
	return nil
}

// Close does nothing: the publisher is shared, and Broker.Close closes it.
func (p *publisher) Close() error { return nil }

// subscriber is the Subscriber a Broker hands out. It puts a relay between the upstream
// adapter and the consumer: the consumer gets a copy of each message (same UUID, metadata,
// payload and context), and the relay passes the copy's ack or nack upstream. That gives every
// scheme the same behaviour where the adapters differ: a delay before a nack reaches an
// adapter that would redeliver at once, a nack for the message a closing consumer holds, and
// a Close that is idempotent and safe to call concurrently.
type subscriber struct {
	b  *Broker
	up message.Subscriber

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	cancels []context.CancelFunc
	relays  sync.WaitGroup

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

func newSubscriber(b *Broker, up message.Subscriber) *subscriber {
	return &subscriber{b: b, up: up, closing: make(chan struct{})}
}

// Subscribe starts one competing consumer of topic. The returned channel is closed when ctx
// ends or the Subscriber closes.
//
// The adapter's subscription does not end with ctx at once: a watermill router that closes
// cancels the context of its subscriptions at the same time as it closes their Subscriber,
// and an adapter whose subscription is cancelled drops the acks it has not passed on yet
// (watermill-sql rolls back the offset of the messages acked in the batch, watermill-amqp
// requeues the message). When ctx ends, the relay stops handing out messages at once, and
// the adapter's subscription is cancelled after closeGrace, unless Close, which lets it stop
// on its own first, comes before.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.b.checkTopic(topic); err != nil {
		return nil, err
	}
	if s.b.be.native {
		return s.subscribeNative(ctx, topic)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	upCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancels = append(s.cancels, cancel)
	s.relays.Add(1)
	s.mu.Unlock()

	in, err := s.up.Subscribe(upCtx, topic)
	if err != nil {
		cancel()
		s.relays.Done()
		return nil, redact.Error(fmt.Errorf("broker: subscribe to %q on %s: %w", topic, s.b.redacted, err), s.b.secrets)
	}
	out := make(chan *message.Message)
	go s.relay(ctx, in, out)
	go func() {
		select {
		case <-ctx.Done():
		case <-s.closing:
			return // Close cancels the subscription after its grace
		}
		t := time.NewTimer(closeGrace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-s.closing:
		}
	}()
	return out, nil
}

// subscribeNative subscribes on an adapter that keeps many deliveries in flight itself
// (backend.native): its channel is handed out as it is. The adapter ends the subscription when
// ctx ends or it closes, and settles what it has handed out as its documentation says.
func (s *subscriber) subscribeNative(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	in, err := s.up.Subscribe(ctx, topic)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("broker: subscribe to %q on %s: %w", topic, s.b.redacted, err), s.b.secrets)
	}
	return in, nil
}

// relay passes messages from in to out, one at a time, and each one's ack or nack back.
func (s *subscriber) relay(ctx context.Context, in <-chan *message.Message, out chan<- *message.Message) {
	defer s.relays.Done()
	defer close(out)
	be := s.b.be
	// giveBack is what happens to a message the consumer will not settle.
	giveBack := func(m *message.Message) {
		if be.nackOnClose {
			m.Nack()
		}
	}
	for {
		var m *message.Message
		select {
		case <-s.closing:
			return
		case <-ctx.Done():
			return
		case got, ok := <-in:
			if !ok {
				return
			}
			m = got
		}

		c := m.Copy()
		c.SetContext(m.Context())
		select {
		case out <- c:
		case <-m.Context().Done():
			// The adapter gave the message up before the consumer took it (its ack deadline
			// passed, its subscription ended): it delivers it again, so do not hand out a
			// stale copy.
			giveBack(m)
			continue
		case <-s.closing:
			giveBack(m)
			return
		case <-ctx.Done():
			giveBack(m)
			return
		}

		select {
		case <-c.Acked():
			m.Ack()
		case <-c.Nacked():
			if d := be.relayNackDelay; d > 0 {
				t := time.NewTimer(d)
				select {
				case <-t.C:
				case <-s.closing:
				case <-ctx.Done():
				}
				t.Stop()
			}
			m.Nack()
		case <-s.closing:
			settleOrGiveBack(c, m, giveBack)
			return
		case <-ctx.Done():
			settleOrGiveBack(c, m, giveBack)
			return
		}
	}
}

// settleOrGiveBack passes on the ack or nack of c that the consumer gave before the relay
// noticed that it must stop (both were ready, and select chose the stop), and gives m back
// when c was not settled. An ack given before Close must not be lost.
func settleOrGiveBack(c, m *message.Message, giveBack func(*message.Message)) {
	select {
	case <-c.Acked():
		m.Ack()
	case <-c.Nacked():
		m.Nack()
	default:
		giveBack(m)
	}
}

// Close ends the subscriptions and closes the upstream subscriber. Messages a consumer held
// without acknowledging them are delivered again. Close is idempotent; concurrent calls all
// return when the first one is done, with its result.
func (s *subscriber) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		close(s.closing)
		cancels := s.cancels
		s.mu.Unlock()

		s.relays.Wait()
		done := make(chan error, 1)
		go func() { done <- s.up.Close() }()
		var err error
		select {
		case err = <-done:
		case <-time.After(closeGrace):
			// The adapter is stuck, typically in a query waiting for a lock that another
			// consumer holds: cancel its queries.
			for _, cancel := range cancels {
				cancel()
			}
			err = <-done
		}
		for _, cancel := range cancels {
			cancel()
		}
		s.b.forget(s)
		if err != nil {
			s.closeErr = redact.Error(fmt.Errorf("broker: close subscriber of %s: %w", s.b.redacted, err), s.b.secrets)
		}
	})
	return s.closeErr
}
