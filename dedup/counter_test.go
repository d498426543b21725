package dedup_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

func newCounter(t *testing.T, db *sqldb.DB) *dedup.Counter {
	t.Helper()
	c, err := dedup.NewCounter(db, dedup.CounterConfig{Table: testsvc.UniqueName("deliveries")})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE ` + db.Dialect.Quote(c.Table())) })
	return c
}

// forEachCounter runs test in parallel on a fresh, migrated counter on every dialect.
func forEachCounter(t *testing.T, test func(t *testing.T, ctx context.Context, c *dedup.Counter)) {
	t.Helper()
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			c := newCounter(t, d.Open(t))
			require.NoError(t, c.Migrate(ctx))
			test(t, ctx, c)
		})
	}
}

func TestCounter_CountsDeliveriesAttemptsAndGroupedRunsApart(t *testing.T) {
	forEachCounter(t, func(t *testing.T, ctx context.Context, c *dedup.Counter) {
		n, err := c.Count(ctx, "billing", "m1", 2)
		require.NoError(t, err)
		require.Equal(t, 2, n, "the first count starts at initial")
		n, err = c.Count(ctx, "billing", "m1", 2)
		require.NoError(t, err)
		require.Equal(t, 3, n)

		a, err := c.Attempt(ctx, "billing", "m1")
		require.NoError(t, err)
		require.Equal(t, 1, a, "attempts are counted apart from deliveries")
		a, err = c.Attempt(ctx, "billing", "m1")
		require.NoError(t, err)
		require.Equal(t, 2, a)
		n, err = c.Count(ctx, "billing", "m1", 2)
		require.NoError(t, err)
		require.Equal(t, 4, n, "an attempt does not count a delivery")

		a, err = c.Attempt(ctx, "billing", "m2")
		require.NoError(t, err)
		require.Equal(t, 1, a, "a message whose deliveries the broker counts has attempts only")
		a, err = c.Attempt(ctx, "shipping", "m1")
		require.NoError(t, err)
		require.Equal(t, 1, a, "handlers count apart")

		for want := 1; want <= 2; want++ {
			g, err := c.Grouped(ctx, "billing", "m1")
			require.NoError(t, err)
			require.Equal(t, want, g, "grouped runs are counted apart from attempts")
		}
		a, err = c.Attempt(ctx, "billing", "m1")
		require.NoError(t, err)
		require.Equal(t, 3, a, "a grouped run is no attempt")
	})
}

func TestCounter_MigrateAddsAttemptsToAnOlderTable(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := d.Open(t)
			c := newCounter(t, db)
			_, err := db.Exec(`CREATE TABLE ` + db.Dialect.Quote(c.Table()) + ` (
	handler VARCHAR(255) NOT NULL, message_id VARCHAR(255) NOT NULL,
	deliveries INTEGER NOT NULL, updated_at BIGINT NOT NULL, PRIMARY KEY (handler, message_id))`)
			require.NoError(t, err)
			n, err := c.Count(ctx, "billing", "m1", 1)
			require.NoError(t, err)
			require.Equal(t, 1, n)

			require.NoError(t, c.Migrate(ctx))
			require.NoError(t, c.Migrate(ctx), "idempotent")
			a, err := c.Attempt(ctx, "billing", "m1")
			require.NoError(t, err)
			require.Equal(t, 1, a)
			n, err = c.Count(ctx, "billing", "m1", 1)
			require.NoError(t, err)
			require.Equal(t, 2, n, "the older rows keep their counts")
			require.NoError(t, c.MarkDeadLettered(ctx, "billing", "m1"))
			dead, err := c.DeadLettered(ctx, "billing", "m1")
			require.NoError(t, err)
			require.True(t, dead)
			require.NoError(t, c.MarkProcessed(ctx, "billing", "m1"))
			done, err := c.Processed(ctx, "billing", "m1")
			require.NoError(t, err)
			require.True(t, done)
			g, err := c.Grouped(ctx, "billing", "m1")
			require.NoError(t, err)
			require.Equal(t, 1, g)
		})
	}
}

func TestCounter_RemembersProcessedRedeliveries(t *testing.T) {
	forEachCounter(t, func(t *testing.T, ctx context.Context, c *dedup.Counter) {
		done, err := c.Processed(ctx, "billing", "m1")
		require.NoError(t, err)
		require.False(t, done, "no row")
		a, err := c.Attempt(ctx, "billing", "m1")
		require.NoError(t, err)
		require.Equal(t, 1, a)
		done, err = c.Processed(ctx, "billing", "m1")
		require.NoError(t, err)
		require.False(t, done, "attempted, not processed")

		require.NoError(t, c.MarkProcessed(ctx, "billing", "m1"))
		require.NoError(t, c.MarkProcessed(ctx, "billing", "m1"), "idempotent")
		done, err = c.Processed(ctx, "billing", "m1")
		require.NoError(t, err)
		require.True(t, done)
		done, err = c.Processed(ctx, "shipping", "m1")
		require.NoError(t, err)
		require.False(t, done, "handlers apart")
		dead, err := c.DeadLettered(ctx, "billing", "m1")
		require.NoError(t, err)
		require.False(t, dead, "processed is not dead-lettered")
		a, err = c.Attempt(ctx, "billing", "m1")
		require.NoError(t, err)
		require.Equal(t, 2, a, "the mark leaves the attempts alone")
	})
}

func TestCounter_RemembersDeadLetters(t *testing.T) {
	forEachCounter(t, func(t *testing.T, ctx context.Context, c *dedup.Counter) {
		dead, err := c.DeadLettered(ctx, "billing", "m1")
		require.NoError(t, err)
		require.False(t, dead, "no row")
		n, err := c.Count(ctx, "billing", "m1", 1)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		dead, err = c.DeadLettered(ctx, "billing", "m1")
		require.NoError(t, err)
		require.False(t, dead, "counted, not dead-lettered")

		require.NoError(t, c.MarkDeadLettered(ctx, "billing", "m1"))
		require.NoError(t, c.MarkDeadLettered(ctx, "billing", "m2"))
		for _, id := range []string{"m1", "m2"} {
			dead, err = c.DeadLettered(ctx, "billing", id)
			require.NoError(t, err)
			require.True(t, dead, id)
		}
		dead, err = c.DeadLettered(ctx, "shipping", "m1")
		require.NoError(t, err)
		require.False(t, dead, "handlers apart")
		n, err = c.Count(ctx, "billing", "m1", 1)
		require.NoError(t, err)
		require.Equal(t, 2, n, "the mark leaves the count alone")
	})
}

// A row that a mark wrote for a message whose first delivery went uncounted holds no
// deliveries: the next count, a redelivery, is still the second.
func TestCounter_CountAfterAMarkOfAnUncountedFirstDeliveryStartsAtInitial(t *testing.T) {
	forEachCounter(t, func(t *testing.T, ctx context.Context, c *dedup.Counter) {
		marks := map[string]func(id string) error{
			"dead-lettered": func(id string) error { return c.MarkDeadLettered(ctx, "billing", id) },
			"processed":     func(id string) error { return c.MarkProcessed(ctx, "billing", id) },
			"attempted":     func(id string) error { _, err := c.Attempt(ctx, "billing", id); return err },
		}
		for name, mark := range marks {
			require.NoError(t, mark(name))
			n, err := c.Count(ctx, "billing", name, 2)
			require.NoError(t, err)
			require.Equal(t, 2, n, "after %s: the redelivery of a first delivery the broker reported", name)
			n, err = c.Count(ctx, "billing", name, 2)
			require.NoError(t, err)
			require.Equal(t, 3, n, "after %s: the delivery after it", name)
		}
	})
}
