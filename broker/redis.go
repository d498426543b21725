package broker

import (
	"context"
	"errors"
	"sync"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	redissub "github.com/onceflow/onceflow/broker/redis"
)

// HeaderRedisMetadata carries the raw "metadata" field of a Redis stream entry that did not
// decode as watermill metadata (an entry written by another producer).
const HeaderRedisMetadata = redissub.HeaderMetadata

// redisMarshaller is the stream entry format of watermill-redisstream, with an Unmarshal that
// never fails.
type redisMarshaller = redissub.Marshaller

// openRedis publishes with watermill-redisstream's publisher and subscribes with
// broker/redis, which keeps many deliveries in flight per subscription, delays nacked entries
// in Redis (their idle time), and gives back at once what a closing consumer holds.
func openRedis(ctx context.Context, t *target, o Options) (*backend, error) {
	ropts, err := redis.ParseURL(t.dsn)
	if err != nil {
		return nil, err
	}
	client := redis.NewClient(ropts)
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		return nil, err
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client, Marshaller: redisMarshaller{}}, o.Logger)
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	// A subscription notices a lost connection by a failed command: the subscribers' clients
	// do not retry.
	subOpts := *ropts
	subOpts.MaxRetries = -1
	nackDelay := o.NackDelay
	if nackDelay == NoNackDelay {
		nackDelay = redissub.NoNackDelay
	}
	cfg := redissub.Config{
		ConsumerGroup: o.ConsumerGroup,
		Prefetch:      o.Prefetch,
		NackDelay:     nackDelay,
		AckTimeout:    o.AckTimeout,
		CloseTimeout:  closeGrace,
		Logger:        o.Logger,
	}
	if err := cfg.Validate(); err != nil {
		_ = pub.Close()
		return nil, err
	}
	return &backend{
		pub: pub,
		newSubscriber: func() (message.Subscriber, error) {
			// Each Subscriber has a connection pool of its own, closed with it. NewClient
			// writes to its options: give each its copy.
			opts := subOpts
			c := redis.NewClient(&opts)
			sub, err := redissub.NewSubscriber(c, cfg)
			if err != nil {
				_ = c.Close()
				return nil, err
			}
			return &redisSubscriber{Subscriber: sub, client: c}, nil
		},
		native: true,
		// Closing the publisher closes client.
		view: newRedisView(client, o.ConsumerGroup),
	}, nil
}

// redisSubscriber is a broker/redis Subscriber with the client that it alone uses.
type redisSubscriber struct {
	*redissub.Subscriber
	client *redis.Client

	once sync.Once
	err  error
}

// Close closes the Subscriber, then its client.
func (s *redisSubscriber) Close() error {
	s.once.Do(func() { s.err = errors.Join(s.Subscriber.Close(), s.client.Close()) })
	return s.err
}
