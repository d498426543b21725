package redis

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestReapScript_DeletesOnlyConsumersWithNothingPendingIdleLongEnough(t *testing.T) {
	t.Parallel()
	rawURL := testsvc.RedisURL(t)
	topic := testsvc.UniqueName("t")
	t.Cleanup(func() { testsvc.RemoveTopics(t, rawURL, nil, topic) })
	opts, err := redis.ParseURL(rawURL)
	require.NoError(t, err)
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()

	require.NoError(t, c.XGroupCreateMkStream(ctx, topic, "g", "0").Err())
	require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: topic, Values: map[string]any{"payload": "x"}}).Err())
	_, err = c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "holding", Streams: []string{topic, ">"}, Block: -1}).Result()
	require.NoError(t, err)
	require.NoError(t, c.XGroupCreateConsumer(ctx, topic, "g", "idle").Err())
	require.NoError(t, c.XGroupCreateConsumer(ctx, topic, "g", "other").Err())
	names := func() []string {
		cs, err := c.XInfoConsumers(ctx, topic, "g").Result()
		require.NoError(t, err)
		var out []string
		for _, x := range cs {
			out = append(out, x.Name)
		}
		return out
	}

	n, err := reapScript.Run(ctx, c, []string{topic}, "g", 3_600_000, "").Int()
	require.NoError(t, err)
	require.Zero(t, n, "nobody has been idle for an hour")
	n, err = reapScript.Run(ctx, c, []string{topic}, "g", 0, "idle").Int()
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.ElementsMatch(t, []string{"holding", "other"}, names())
	n, err = reapScript.Run(ctx, c, []string{topic}, "g", 0, "").Int()
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{"holding"}, names(), "a consumer with a pending entry stays")
}
