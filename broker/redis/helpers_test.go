package redis_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/internal/tcpproxy"
	"github.com/onceflow/onceflow/internal/testsvc"
)

const group = "g"

// fixture is one test's Redis server and stream.
type fixture struct {
	t     *testing.T
	url   string
	topic string
	admin *redis.Client // for assertions, beside the subscribers
	// direct makes the fixture's subscriptions those of a consumer that settles each message
	// itself (redelivery.WithDirectSettle), through settler.
	direct  bool
	settler testsvc.Settler
}

// inBothModes runs test twice, in parallel, each with a fixture of its own: as a consumer that
// only acks and nacks (the subscriber watches every message), and as one that also tells the
// subscriber of each ack and nack itself (redelivery.Settle), as onceflow's router does.
func inBothModes(t *testing.T, test func(t *testing.T, f *fixture)) {
	t.Helper()
	testsvc.ForEachSettleMode(t, "", true, func(t *testing.T, direct bool) {
		f := setup(t)
		f.direct = direct
		test(t, f)
	})
}

func setup(t *testing.T) *fixture {
	t.Helper()
	u := testsvc.RedisURL(t)
	f := &fixture{t: t, url: u, topic: testsvc.UniqueName("t")}
	t.Cleanup(func() { testsvc.RemoveTopics(t, u, nil, f.topic) })
	f.admin = f.client(u)
	return f
}

// client returns a client of the server at rawURL as a subscriber should have it (no
// retries), closed when the test ends.
func (f *fixture) client(rawURL string) *redis.Client {
	f.t.Helper()
	opts, err := redis.ParseURL(rawURL)
	require.NoError(f.t, err)
	opts.MaxRetries = -1
	c := redis.NewClient(opts)
	f.t.Cleanup(func() { _ = c.Close() })
	return c
}

// subscriber returns a Subscriber over a client of its own of rawURL, closed when the test
// ends.
func (f *fixture) subscriber(rawURL string, cfg redissub.Config) *redissub.Subscriber {
	f.t.Helper()
	if cfg.ConsumerGroup == "" {
		cfg.ConsumerGroup = group
	}
	sub, err := redissub.NewSubscriber(f.client(rawURL), cfg)
	require.NoError(f.t, err)
	f.t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// subscribe subscribes a new Subscriber with cfg to the fixture's stream.
func (f *fixture) subscribe(cfg redissub.Config) (*redissub.Subscriber, <-chan *message.Message) {
	f.t.Helper()
	sub := f.subscriber(f.url, cfg)
	ch, err := f.subscribeWith(context.Background(), sub)
	require.NoError(f.t, err)
	return sub, ch
}

// subscribeWith subscribes sub to the fixture's stream with ctx, in the fixture's mode.
func (f *fixture) subscribeWith(ctx context.Context, sub *redissub.Subscriber) (<-chan *message.Message, error) {
	if !f.direct {
		return sub.Subscribe(ctx, f.topic)
	}
	ch, err := sub.Subscribe(redelivery.WithDirectSettle(ctx), f.topic)
	if err != nil {
		return nil, err
	}
	return f.settler.Settling(f.t, ch), nil
}

// publish publishes n messages with watermill-redisstream's publisher and returns them.
func (f *fixture) publish(n int) []*message.Message {
	f.t.Helper()
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: f.admin, Marshaller: redissub.Marshaller{}}, nil)
	require.NoError(f.t, err)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("%s-%04d", f.topic, i), []byte(fmt.Sprintf("payload %d", i)))
		msgs[i].Metadata.Set("i", fmt.Sprint(i))
	}
	require.NoError(f.t, pub.Publish(f.topic, msgs...))
	return msgs
}

// pendingCount returns how many entries of the stream are pending for the group.
func (f *fixture) pendingCount() int64 {
	f.t.Helper()
	p, err := f.admin.XPending(context.Background(), f.topic, group).Result()
	require.NoError(f.t, err)
	return p.Count
}

// pendingOf returns the pending entry of the group for the message with uuid, failing the
// test when there is none.
func (f *fixture) pendingOf(uuid string) redis.XPendingExt {
	f.t.Helper()
	ctx := context.Background()
	xps, err := f.admin.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: f.topic, Group: group, Start: "-", End: "+", Count: 10000}).Result()
	require.NoError(f.t, err)
	for _, xp := range xps {
		got, err := f.admin.XRange(ctx, f.topic, xp.ID, xp.ID).Result()
		require.NoError(f.t, err)
		if len(got) == 1 && got[0].Values[redisstream.UUIDHeaderKey] == uuid {
			return xp
		}
	}
	f.t.Fatalf("message %s is not pending", uuid)
	return redis.XPendingExt{}
}

// tcpProxy is an in-process loopback TCP proxy in front of the Redis server.
type tcpProxy struct {
	p   *tcpproxy.Proxy
	url string // the server's URL through the proxy
}

func (f *fixture) proxy() *tcpProxy {
	f.t.Helper()
	p, through, err := tcpproxy.ForURL(f.url)
	require.NoError(f.t, err)
	f.t.Cleanup(p.Close)
	return &tcpProxy{p: p, url: through}
}

// cut closes every connection through the proxy and refuses new ones until restore.
func (p *tcpProxy) cut() { p.p.Cut() }

// restore accepts connections again, on the same address.
func (p *tcpProxy) restore(t *testing.T) {
	t.Helper()
	require.NoError(t, p.p.Restore())
}
