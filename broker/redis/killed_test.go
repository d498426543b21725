package redis_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// Environment of the consumer process that the killed-consumer tests start (this test binary,
// running TestKilledConsumer_Child).
const (
	childURLEnv    = "ONCEFLOW_REDIS_TEST_CHILD_URL"
	childTopicEnv  = "ONCEFLOW_REDIS_TEST_CHILD_TOPIC"
	childNackEnv   = "ONCEFLOW_REDIS_TEST_CHILD_NACK_AFTER" // a delay: nack with it instead of holding
	childAckTOEnv  = "ONCEFLOW_REDIS_TEST_CHILD_ACK_TIMEOUT"
	childDirectEnv = "ONCEFLOW_REDIS_TEST_CHILD_DIRECT" // set: settle directly (redelivery.WithDirectSettle)
	childNackedAs  = "NACKED"
)

// TestKilledConsumer_Child is the consumer process of the killed-consumer tests. It takes the
// first delivery of the topic and says so on stdout (HOLDING <uuid> <count>). With a nack
// delay, it nacks the delivery with it, waits until Redis has the delay, and says so (NACKED
// <uuid> <unix ms of the nack>). Then it waits to be killed.
func TestKilledConsumer_Child(t *testing.T) {
	rawURL := os.Getenv(childURLEnv)
	if rawURL == "" {
		t.Skip("run by the killed-consumer tests")
	}
	topic := os.Getenv(childTopicEnv)
	ackTimeout, err := time.ParseDuration(os.Getenv(childAckTOEnv))
	require.NoError(t, err)
	opts, err := redis.ParseURL(rawURL)
	require.NoError(t, err)
	opts.MaxRetries = -1
	client := redis.NewClient(opts)
	sub, err := redissub.NewSubscriber(client, redissub.Config{ConsumerGroup: group, AckTimeout: ackTimeout})
	require.NoError(t, err)
	ctx := context.Background()
	direct := os.Getenv(childDirectEnv) != ""
	if direct {
		ctx = redelivery.WithDirectSettle(ctx)
	}
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := testsvc.Receive(t, ch, 30*time.Second)
	testsvc.SayHolding(t, m)
	if v := os.Getenv(childNackEnv); v != "" {
		delay, err := time.ParseDuration(v)
		require.NoError(t, err)
		nackedAt := time.Now()
		require.True(t, redelivery.NackAfter(m, delay))
		redelivery.Settle(m)
		// The delay is in Redis once the entry's idle time has jumped ahead.
		for {
			xps, err := client.XPendingExt(context.Background(), &redis.XPendingExtArgs{Stream: topic, Group: group, Start: "-", End: "+", Count: 1}).Result()
			require.NoError(t, err)
			if len(xps) == 1 && xps[0].Idle > ackTimeout-delay-time.Second {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		fmt.Printf("%s %s %d\n", childNackedAs, m.UUID, nackedAt.UnixMilli())
	}
	select {}
}

// startChild starts a consumer process of the fixture's topic (TestKilledConsumer_Child).
func (f *fixture) startChild(ackTimeout, nackAfter time.Duration) *testsvc.Child {
	f.t.Helper()
	env := []string{childURLEnv + "=" + f.url, childTopicEnv + "=" + f.topic, childAckTOEnv + "=" + ackTimeout.String()}
	if nackAfter > 0 {
		env = append(env, childNackEnv+"="+nackAfter.String())
	}
	if f.direct {
		env = append(env, childDirectEnv+"=1")
	}
	return testsvc.StartChild(f.t, env...)
}

// A crash loop caused by one message must end: each consumer killed while holding the entry
// leaves it to the next with the delivery count one higher, because the count is Redis's.
func TestKilledConsumer_DeliveryCountSurvives(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		want := f.publish(1)[0]
		const ackTimeout = 500 * time.Millisecond

		for n := 1; n <= 2; n++ {
			c := f.startChild(ackTimeout, 0)
			id, count := c.Holding(t, time.Minute)
			require.Equal(t, want.UUID, id)
			require.Equal(t, n, count, "delivery count seen by consumer process %d", n)
			c.Kill()
		}
		_, ch := f.subscribe(redissub.Config{AckTimeout: ackTimeout})
		m := testsvc.Receive(t, ch, 30*time.Second)
		require.Equal(t, want.UUID, m.UUID)
		require.Equal(t, 3, testsvc.Info(t, m).Count)
		m.Ack()
	})
}

// The delay of a nack is kept in Redis: the entry of a consumer killed right after it nacked
// comes back to another consumer when the delay has passed, not sooner, and well before the
// ack timeout.
func TestKilledConsumer_DelayedNackStillComesBack(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		want := f.publish(1)[0]
		const ackTimeout, delay = 10 * time.Second, 1500 * time.Millisecond

		c := f.startChild(ackTimeout, delay)
		_, count := c.Holding(t, time.Minute)
		require.Equal(t, 1, count)
		var id string
		var nackedMs int64
		_, err := fmt.Sscanf(c.Expect(t, childNackedAs, time.Minute), "%s %d", &id, &nackedMs)
		require.NoError(t, err)
		c.Kill()
		nacked := time.UnixMilli(nackedMs)

		_, ch := f.subscribe(redissub.Config{AckTimeout: ackTimeout})
		m := testsvc.Receive(t, ch, 30*time.Second)
		since := time.Since(nacked)
		require.Equal(t, want.UUID, m.UUID)
		require.GreaterOrEqual(t, since, delay, "came back before the delay")
		require.Less(t, since, ackTimeout, "came back by the ack timeout, not by the delay")
		require.Equal(t, 2, testsvc.Info(t, m).Count)
		m.Ack()
	})
}
