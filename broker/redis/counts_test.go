package redis_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// The subscriber relies on how Redis counts deliveries and keeps idle times; this pins it on
// the server under test.
func TestRedis_ClaimsCountDeliveriesAndJustIDDoesNot(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	c := f.admin
	require.NoError(t, c.XGroupCreateMkStream(ctx, f.topic, group, "0").Err())
	id, err := c.XAdd(ctx, &redis.XAddArgs{Stream: f.topic, Values: map[string]any{"payload": "x"}}).Result()
	require.NoError(t, err)
	state := func() redis.XPendingExt {
		t.Helper()
		xps, err := c.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: f.topic, Group: group, Start: id, End: id, Count: 1}).Result()
		require.NoError(t, err)
		require.Len(t, xps, 1)
		return xps[0]
	}

	_, err = c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "a", Streams: []string{f.topic, ">"}, Count: 1, Block: -1}).Result()
	require.NoError(t, err)
	require.EqualValues(t, 1, state().RetryCount, "XREADGROUP > delivers a new entry with count 1")

	_, err = c.XClaim(ctx, &redis.XClaimArgs{Stream: f.topic, Group: group, Consumer: "b", Messages: []string{id}}).Result()
	require.NoError(t, err)
	require.EqualValues(t, 2, state().RetryCount, "XCLAIM counts a delivery")
	require.Equal(t, "b", state().Consumer)

	// A nack: XCLAIM to itself with IDLE and JUSTID sets the idle time and leaves the count.
	ids, err := c.Do(ctx, "XCLAIM", f.topic, group, "b", 0, id, "IDLE", 25000, "JUSTID").StringSlice()
	require.NoError(t, err)
	require.Equal(t, []string{id}, ids)
	st := state()
	require.EqualValues(t, 2, st.RetryCount, "XCLAIM JUSTID does not count a delivery")
	require.GreaterOrEqual(t, st.Idle, 25*time.Second)
	require.Less(t, st.Idle, 26*time.Second)

	// A claim with a minimum idle time takes the entry only when it is idle that long.
	ids, err = c.Do(ctx, "XCLAIM", f.topic, group, "c", 30000, id, "JUSTID").StringSlice()
	require.NoError(t, err)
	require.Empty(t, ids, "idle 25 s is not idle 30 s")
	msgs, _, err := c.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: f.topic, Group: group, Consumer: "c", MinIdle: 30 * time.Second, Start: "0-0", Count: 10}).Result()
	require.NoError(t, err)
	require.Empty(t, msgs)
	msgs, _, err = c.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: f.topic, Group: group, Consumer: "c", MinIdle: 20 * time.Second, Start: "0-0", Count: 10}).Result()
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	st = state()
	require.EqualValues(t, 3, st.RetryCount, "XAUTOCLAIM counts a delivery")
	require.Equal(t, "c", st.Consumer)
	require.Less(t, st.Idle, time.Second, "a claim restarts the idle time")

	// Redis sets no idle time ahead of its clock: a delivery time in the future is now. So a
	// delay longer than the claims' minimum idle time cannot be set in one XCLAIM.
	future := time.Now().Add(time.Hour).UnixMilli()
	_, err = c.Do(ctx, "XCLAIM", f.topic, group, "c", 0, id, "TIME", future, "JUSTID").StringSlice()
	require.NoError(t, err)
	require.Less(t, state().Idle, time.Second)

	// An entry deleted while pending leaves the pending entries list at its next claim.
	require.NoError(t, c.XDel(ctx, f.topic, id).Err())
	msgs, err = c.XClaim(ctx, &redis.XClaimArgs{Stream: f.topic, Group: group, Consumer: "c", Messages: []string{id}}).Result()
	require.NoError(t, err)
	require.Empty(t, msgs)
	p, err := c.XPending(ctx, f.topic, group).Result()
	require.NoError(t, err)
	require.Zero(t, p.Count)
}
