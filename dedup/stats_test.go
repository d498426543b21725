package dedup_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
)

func TestHandlers_ListsTheHandlersClaimedInTheDatabase(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		claims, err := e.store.Handlers(ctx)
		require.NoError(t, err)
		require.Empty(t, claims, "no router has run")

		require.NoError(t, e.store.ClaimHandler(ctx, "shipping", "orders"))
		require.NoError(t, e.store.ClaimHandler(ctx, "billing", "payments"))
		claims, err = e.store.Handlers(ctx)
		require.NoError(t, err)
		require.Equal(t, []dedup.Claim{
			{Handler: "billing", Topic: "payments", ClaimedAt: t0.Local()},
			{Handler: "shipping", Topic: "orders", ClaimedAt: t0.Local()},
		}, claims)
	})
}

func TestHandlerKeys_CountsEachHandlersKeysAndTheRecentOnes(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		e.clock.Set(t0.Add(-2 * time.Minute))
		e.recordManyCommitted(t, keys("old-", 3)) // handler billing
		e.clock.Set(t0)
		e.recordCommitted(t, key("new-1"), "")
		e.recordCommitted(t, dedup.Key{Handler: "shipping", MessageID: "s-1"}, "")

		got, err := e.store.HandlerKeys(context.Background(), t0.Add(-time.Minute))
		require.NoError(t, err)
		require.Equal(t, map[string]dedup.HandlerStats{
			"billing":  {Keys: 4, Recent: 1, Last: t0.Local()},
			"shipping": {Keys: 1, Recent: 1, Last: t0.Local()},
		}, got)
	})
}

func TestCounter_HandlerStatsCountRedeliveredAndDeadLetteredMessages(t *testing.T) {
	forEachCounter(t, func(t *testing.T, ctx context.Context, c *dedup.Counter) {
		for _, id := range []string{"m1", "m2", "m3"} {
			_, err := c.Count(ctx, "billing", id, 1)
			require.NoError(t, err)
		}
		_, err := c.Count(ctx, "billing", "m1", 1) // m1 delivered again
		require.NoError(t, err)
		_, err = c.Attempt(ctx, "billing", "m2") // m2's delivery counted by the broker, its attempt here
		require.NoError(t, err)
		require.NoError(t, c.MarkDeadLettered(ctx, "billing", "m1"))
		require.NoError(t, c.MarkDeadLettered(ctx, "shipping", "s1"))

		got, err := c.HandlerStats(ctx)
		require.NoError(t, err)
		require.Equal(t, map[string]dedup.CounterStats{
			"billing":  {Redelivered: 2, DeadLettered: 1},
			"shipping": {Redelivered: 0, DeadLettered: 1},
		}, got)
	})
}
