package redis_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// BenchmarkSubscriber_ConsumeAndAck drains a backlog of b.N entries with one subscription
// that acks each message as it arrives, with this package's subscriber and with
// watermill-redisstream's (configured as onceflow configured it), and reports msgs/s from the
// Subscribe to the end of Close, when every ack is in Redis, and the process's allocations
// and µs of CPU per message over that time. "onceflow-direct" is this package's subscriber
// with a consumer that settles each message itself (redelivery.Settle after each ack), as
// onceflow's router does. Give a fixed count, so that both
// drain the same backlog, and compare the two in one run:
//
//	go test -run '^$' -bench BenchmarkSubscriber_ -benchtime 20000x ./broker/redis
func BenchmarkSubscriber_ConsumeAndAck(b *testing.B) {
	u := testsvc.RedisURL(b)
	onceflow := func(b *testing.B, c *redis.Client) message.Subscriber {
		sub, err := redissub.NewSubscriber(c, redissub.Config{ConsumerGroup: group})
		require.NoError(b, err)
		return sub
	}
	for _, impl := range []struct {
		name   string
		new    func(b *testing.B, c *redis.Client) message.Subscriber
		direct bool // the consumer settles each message itself, as onceflow's router does
	}{
		{"onceflow", onceflow, false},
		{"onceflow-direct", onceflow, true},
		{"watermill-redisstream", func(b *testing.B, c *redis.Client) message.Subscriber {
			sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
				Client:                        c,
				Unmarshaller:                  redissub.Marshaller{},
				Consumer:                      "bench-" + watermill.NewShortUUID(),
				ConsumerGroup:                 group,
				NackResendSleep:               time.Second,
				BlockTime:                     100 * time.Millisecond,
				ClaimInterval:                 time.Second,
				MaxIdleTime:                   30 * time.Second,
				OldestId:                      "0",
				DisableIndefiniteInitialBlock: true,
			}, nil)
			require.NoError(b, err)
			return sub
		}, false},
	} {
		b.Run(impl.name, func(b *testing.B) {
			topic := testsvc.UniqueName("bench")
			b.Cleanup(func() { testsvc.RemoveTopics(b, u, nil, topic) })
			opts, err := redis.ParseURL(u)
			require.NoError(b, err)
			opts.MaxRetries = -1
			admin := redis.NewClient(opts)
			defer admin.Close()
			fill(b, admin, topic, b.N)
			c := redis.NewClient(opts)
			defer c.Close() // watermill-redisstream closes it too; a second Close is harmless
			sub := impl.new(b, c)

			ctx := context.Background()
			if impl.direct {
				ctx = redelivery.WithDirectSettle(ctx)
			}
			b.ResetTimer()
			testsvc.Drain(b, sub, ctx, topic, b.N)

			p, err := admin.XPending(context.Background(), topic, group).Result()
			require.NoError(b, err)
			b.ReportMetric(float64(p.Count), "unacked")
		})
	}
}

// fill appends n entries in watermill-redisstream's format to the stream topic, in pipelines.
func fill(b *testing.B, c *redis.Client, topic string, n int) {
	b.Helper()
	ctx := context.Background()
	for done := 0; done < n; {
		pipe := c.Pipeline()
		k := min(n-done, 1000)
		for i := range k {
			m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("payload %d", done+i)))
			values, err := redissub.Marshaller{}.Marshal(topic, m)
			require.NoError(b, err)
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: topic, Values: values})
		}
		_, err := pipe.Exec(ctx)
		require.NoError(b, err)
		done += k
	}
}
