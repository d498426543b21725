package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/outbox"
)

// A relay deletes, every PurgeInterval, what every consumer group has sent: the outbox does not
// grow with every message ever published.
func TestRelay_PurgesWhatEveryGroupHasSentOnItsInterval(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		rec := newRecorder()
		cfg := relayConfig(e, e.db, rec)
		cfg.PurgeInterval, cfg.PurgeBatchSize = 20*time.Millisecond, 4
		r := start(t, cfg)
		e.commitN(t, "first", 10)
		rec.waitFor(t, 10)
		testsvc.Eventually(t, waitTimeout, func() bool { return e.rows(t) == 1 },
			"the relay did not purge the sent messages (the last one a cursor passed stays)")

		e.commitN(t, "second", 10)
		rec.waitFor(t, 20)
		testsvc.Eventually(t, waitTimeout, func() bool { return e.rows(t) == 1 }, "the relay stopped purging")
		require.NoError(t, r.stop(t))
		st, err := e.ob.Stats(context.Background(), "")
		require.NoError(t, err)
		require.Zero(t, st.Backlog)
	})
}

// Relays on several nodes purge one at a time: a relay that finds the purge lock taken skips
// its round.
func TestRelay_PurgeRunsOnOneProcessAtATime(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ctx := context.Background()
		r, err := outbox.NewRelay(relayConfig(e, open(t, e.url), newRecorder()))
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() })

		other, err := outbox.New(open(t, e.url), outbox.Config{})
		require.NoError(t, err)
		unlock, held, err := other.PurgeLock(ctx)
		require.NoError(t, err)
		require.True(t, held)
		require.False(t, r.PurgeNow(ctx), "the relay purged while another process held the purge lock")
		_, again, err := other.PurgeLock(ctx)
		require.NoError(t, err)
		require.False(t, again, "the purge lock was taken twice")
		unlock()
		require.True(t, r.PurgeNow(ctx), "the relay did not purge once the lock was free")
	})
}
