package redis

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// ErrClosed is returned by Subscribe on a closed Subscriber.
var ErrClosed = errors.New("redis: subscriber closed")

// Subscriber is a watermill message.Subscriber on Redis Streams that keeps many deliveries in
// flight per subscription. NewSubscriber makes one; the package documentation describes what
// it guarantees. It is safe for concurrent use.
type Subscriber struct {
	client redis.UniversalClient
	cfg    Config
	subs   *inflight.Group

	mu     sync.Mutex
	passes map[string]*claimPass // by stream

	// readConns counts the subscriptions' connections of their own (subscription.reader).
	readConns atomic.Int32
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber returns a Subscriber that reads with client, which it does not close. Give it
// a client whose commands are not retried (redis.Options.MaxRetries -1): an XREADGROUP sent
// again after its reply was lost leaves the entries of the first one pending until AckTimeout,
// instead of giving them back at once after the failed command tells of the lost connection.
func NewSubscriber(client redis.UniversalClient, cfg Config) (*Subscriber, error) {
	if client == nil {
		return nil, errors.New("redis: NewSubscriber: client is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Subscriber{client: client, cfg: cfg.withDefaults(), subs: inflight.NewGroup(ErrClosed), passes: map[string]*claimPass{}}, nil
}

// Subscribe starts one consumer of the stream topic in the configured consumer group, under a
// consumer name of its own, creating the stream and the group when they do not exist, and
// delivers as the package documentation says until ctx ends or the Subscriber closes.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.subs.Begin("redis", topic); err != nil {
		return nil, err
	}
	sub := newSubscription(s, topic, "onceflow-"+watermill.NewShortUUID())
	start, cancel := context.WithTimeout(context.Background(), s.cfg.CloseTimeout)
	defer cancel()
	if err := sub.ensureGroup(start); err != nil {
		sub.opCancel()
		return nil, fmt.Errorf("redis: subscribe to stream %q: create consumer group %q: %w", topic, s.cfg.ConsumerGroup, err)
	}
	sub.acks = sub.newAcks()
	sub.sub = inflight.New(ctx, sub, inflight.Options{
		Prefetch:     rules.Window(ctx, s.cfg.Prefetch),
		NackDelay:    s.cfg.NackDelay,
		FillWait:     fillWait,
		CloseTimeout: s.cfg.CloseTimeout,
		ErrExpired:   context.DeadlineExceeded,
		Log:          s.cfg.log.With(sub.fields),
	})
	out, err := sub.sub.Start(s.subs)
	if err != nil {
		_, _ = sub.acks.Close() // nothing was added
		sub.opCancel()
		return nil, err
	}
	s.cfg.log.Info("Subscribing to Redis stream", sub.fields)
	go sub.whenStopping()
	return out, nil
}

// Close ends every subscription, as the package documentation says, even if Redis is gone,
// and reports the acks it could not send. It is idempotent; concurrent calls all return when
// the first is done, with its result.
func (s *Subscriber) Close() error { return s.subs.Close(nil) }
