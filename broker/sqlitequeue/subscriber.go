package sqlitequeue

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// subscriber is the Queue's message.Subscriber: each Subscribe call starts a subscription, one
// competing consumer in the queue's consumer group.
type subscriber struct {
	q    *Queue
	subs *inflight.Group
}

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

// Subscribe starts one consumer of topic and returns its messages, as the package
// documentation says (Delivery); the channel is closed when ctx is done or the subscriber
// closes, once the subscription's settlements and give-backs are committed.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.subs.Check(); err != nil {
		return nil, err
	}
	if err := s.q.prepareTopic(ctx, topic, s.q.cfg.ConsumerGroup); err != nil {
		return nil, err
	}
	l, err := prepareLeases(ctx, rawDB(s.q.db), topic, s.q.cfg.ConsumerGroup)
	if err != nil {
		return nil, fmt.Errorf("sqlitequeue: subscribe to topic %q: %w", topic, err)
	}
	sub := &subscription{
		q:           s.q,
		topic:       topic,
		leases:      l,
		logger:      s.q.cfg.log.With(watermill.LogFields{"topic": topic, "consumer_group": s.q.cfg.ConsumerGroup}),
		pending:     s.q.settlements(topic),
		kick:        make(chan struct{}, 1),
		commitsDone: make(chan struct{}),
	}
	sub.opCtx, sub.opCancel = context.WithCancel(context.Background())
	sub.sub = inflight.New(ctx, sub, inflight.Options{
		Prefetch:     rules.Window(ctx, s.q.batchSize),
		NackDelay:    s.q.cfg.ResendInterval,
		FillWait:     fillWait,
		CloseTimeout: closeWait,
		ErrExpired:   errLeasePassed,
		Log:          sub.logger,
	})
	out, err := sub.sub.Start(s.subs)
	if err != nil {
		sub.opCancel()
		l.close()
		return nil, err
	}
	go sub.commits()
	return out, nil
}

// SubscribeInitialize creates topic's tables and records the consumer group.
func (s *subscriber) SubscribeInitialize(topic string) error {
	return s.q.prepareTopic(context.Background(), topic, s.q.cfg.ConsumerGroup)
}

// Close ends the subscriber's subscriptions and waits for them, as the package documentation
// says (Delivery): a few milliseconds, and at most about 5 s when another process keeps the
// queue file locked (the leases then expire by themselves).
func (s *subscriber) Close() error {
	return s.subs.Close(func() error {
		s.q.life.Remove(s)
		return nil
	})
}
