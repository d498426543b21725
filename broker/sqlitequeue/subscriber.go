package sqlitequeue

import (
	"context"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// subscriber is the Queue's message.Subscriber: each Subscribe call starts a subscription, one
// competing consumer in the queue's consumer group.
type subscriber struct {
	q *Queue

	mu      sync.Mutex // guards closed and subs
	closed  bool
	subs    map[*subscription]struct{}
	running sync.WaitGroup // subscriptions' loops

	closeOnce sync.Once
}

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

func newSubscriber(q *Queue) *subscriber {
	return &subscriber{q: q, subs: map[*subscription]struct{}{}}
}

// Subscribe starts one consumer of topic and returns its messages. See Queue.Subscriber for
// the delivery guarantees. The channel is closed when ctx is done or the subscriber closes,
// once the subscription has committed the acknowledgements given before and given back the
// messages it held.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := CheckTopic(topic); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	s.running.Add(1)
	s.mu.Unlock()
	started := false
	defer func() {
		if !started {
			s.running.Done()
		}
	}()

	if err := s.q.prepareTopic(ctx, topic, s.q.cfg.ConsumerGroup); err != nil {
		return nil, err
	}
	l, err := prepareLeases(ctx, rawDB(s.q.db), topic, s.q.cfg.ConsumerGroup)
	if err != nil {
		return nil, fmt.Errorf("sqlitequeue: subscribe to topic %q: %w", topic, err)
	}
	sub := newSubscription(ctx, s.q, topic, l)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		sub.cancel()
		l.close()
		return nil, ErrClosed
	}
	s.subs[sub] = struct{}{}
	s.mu.Unlock()
	started = true
	go func() {
		defer s.running.Done()
		sub.run()
		s.mu.Lock()
		delete(s.subs, sub)
		s.mu.Unlock()
	}()
	return sub.out, nil
}

// SubscribeInitialize creates topic's tables and records the consumer group.
func (s *subscriber) SubscribeInitialize(topic string) error {
	if err := CheckTopic(topic); err != nil {
		return err
	}
	return s.q.prepareTopic(context.Background(), topic, s.q.cfg.ConsumerGroup)
}

// Close ends the subscriber's subscriptions and waits for them: each cancels the contexts of
// the messages it delivered and that are not settled, commits the acknowledgements and nacks
// given before, and gives the other messages back at once to the consumer group. That takes a
// few milliseconds, and at most about 5 s when another process keeps the queue file locked
// (the leases then expire by themselves). Close is idempotent and safe to call concurrently;
// every call returns when the subscriptions have ended.
func (s *subscriber) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		for sub := range s.subs {
			sub.cancel()
		}
		s.mu.Unlock()
		s.running.Wait()
		s.q.forget(s)
	})
	s.running.Wait()
	return nil
}
