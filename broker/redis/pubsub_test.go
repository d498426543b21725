package redis_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// ownClient is a Subscriber that closes its client after itself, as the suite closes what
// its constructors return.
type ownClient struct {
	*redissub.Subscriber
	client *redis.Client
	once   sync.Once
	err    error
	// direct subscribes as a consumer that settles each message itself, through settler,
	// until t ends.
	direct  bool
	t       *testing.T
	settler testsvc.Settler
}

func (s *ownClient) Close() error {
	s.once.Do(func() {
		s.err = errors.Join(s.Subscriber.Close(), s.client.Close())
		s.settler.Wait() // the channels are closed when Close returns
	})
	return s.err
}

// Subscribe subscribes as a consumer that settles each message itself when direct is set.
func (s *ownClient) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if !s.direct {
		return s.Subscriber.Subscribe(ctx, topic)
	}
	ch, err := s.Subscriber.Subscribe(redelivery.WithDirectSettle(ctx), topic)
	if err != nil {
		return nil, err
	}
	return s.settler.Settling(s.t, ch), nil
}

// TestPubSub runs watermill's universal Pub/Sub suite against the subscriber, with
// watermill-redisstream's publisher. Every constructor call makes a publisher and a subscriber
// with clients of their own, as separate processes would; the subscribers of one test share
// the consumer group "test" unless the suite names one.
//
// Features:
//   - ConsumerGroups is true: each group gets every entry, the consumers of a group compete.
//   - ExactlyOnceDelivery is false: delivery is at-least-once. An ack given just before a
//     crash or a lost connection may not reach Redis, and a delivery whose ack timeout passes
//     is claimed again. With it false the suite also runs TestContinueAfterSubscribeClose and
//     TestConcurrentClose.
//   - GuaranteedOrder is false: a subscription keeps many deliveries in flight, and a nacked
//     entry comes back after its delay, behind entries read after it; the consumers of a
//     group share the stream. So TestNoAck and TestPublishSubscribeInOrder are skipped.
//   - Persistent is true: entries are kept in the stream.
//   - NewSubscriberReceivesOldMessages is false: a new subscriber joins its group where the
//     group is; only a new group starts from the beginning of the stream.
//   - RestartServiceCommand is empty, so TestReconnect is skipped: the Redis server is shared.
//     TestSubscriber_LostConnectionRedeliversWhatWasInFlightAndGoesOn cuts the connection
//     through a proxy instead.
//   - ContextPreserved is false: a message's context is not stored.
//
// The suite runs twice: with a consumer that only acks and nacks, and with one that also tells
// the subscriber of each ack and nack (redelivery.WithDirectSettle, see testsvc.Settler).
func TestPubSub(t *testing.T) {
	t.Parallel()
	inBothModes(t, testPubSub)
}

func testPubSub(t *testing.T, f *fixture) {
	prefix := testsvc.UniqueName("pubsub")
	t.Cleanup(func() { removeTopicsWithPrefix(t, f, prefix) })

	newClient := func(t *testing.T) *redis.Client {
		opts, err := redis.ParseURL(f.url)
		require.NoError(t, err)
		opts.MaxRetries = -1
		return redis.NewClient(opts)
	}
	withGroup := func(t *testing.T, consumerGroup string) (message.Publisher, message.Subscriber) {
		pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: newClient(t), Marshaller: redissub.Marshaller{}}, nil)
		require.NoError(t, err)
		c := newClient(t)
		sub, err := redissub.NewSubscriber(c, redissub.Config{
			ConsumerGroup: consumerGroup,
			NackDelay:     100 * time.Millisecond,
			AckTimeout:    5 * time.Second,
		})
		require.NoError(t, err)
		return pub, &ownClient{Subscriber: sub, client: c, direct: f.direct, t: t}
	}
	testsvc.PubSub(t, prefix, withGroup)
}

// removeTopicsWithPrefix removes the streams whose names start with prefix.
func removeTopicsWithPrefix(t *testing.T, f *fixture, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var topics []string
	iter := f.admin.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		topics = append(topics, iter.Val())
	}
	if err := iter.Err(); err != nil {
		t.Logf("list the streams of %s*: %v", prefix, err)
	}
	testsvc.RemoveTopics(t, f.url, nil, topics...)
}
