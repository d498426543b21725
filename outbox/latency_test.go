package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/outbox"
)

// The relay's latency, from the Publish in the handler's transaction, through its commit, to
// the destination's Publish, with the default poll interval. A relay that only polled would
// take half the interval on average; it hears of the Publish instead: from the Outbox of its
// own process on every dialect, and on PostgreSQL from a notification wherever it runs (a
// relay on a pool of another URL stands for one in another process).
func TestRelay_LatencyFromPublishToDestinationIsWellBelowThePollInterval(t *testing.T) {
	if testing.Short() {
		t.Skip("measures latency for a few seconds")
	}
	t.Parallel()
	dbs := testsvc.Databases()
	for _, tc := range []struct {
		name   string
		db     testsvc.Database
		cfg    outbox.Config
		remote bool // the relay's pool has another URL: no wake-up within the process
	}{
		{"sqlite", dbs[0], outbox.Config{}, false},
		{"postgres", dbs[1], outbox.Config{}, false},
		{"mysql", dbs[2], outbox.Config{}, false},
		{"postgres/other-process", dbs[1], outbox.Config{}, true},
		{"postgres/other-process/notify-in-transaction", dbs[1], outbox.Config{NotifyInTransaction: true}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, tc.db, tc.cfg)
			relayURL := e.url
			if tc.remote {
				relayURL += "&application_name=outbox_relay"
			}
			rec := newRecorder()
			cfg := relayConfig(e, open(t, relayURL), rec)
			cfg.PollInterval = outbox.DefaultPollInterval
			r := start(t, cfg)
			e.commitN(t, "warm-up", 1)
			rec.waitFor(t, 1)

			const samples = 25
			total := make([]time.Duration, samples)       // Publish in the transaction -> destination
			afterCommit := make([]time.Duration, samples) // commit returned -> destination
			for i := range total {
				// Publish at a random phase of the relay's poll.
				time.Sleep(time.Duration(rand.Int64N(int64(outbox.DefaultPollInterval))))
				in := fmt.Sprintf("order-%03d", i)
				began := time.Now()
				require.NoError(t, e.process(context.Background(), in, nil, message.NewMessage(outbox.DerivedID(in, "shipped"), []byte(in))))
				committed := time.Now()
				got := rec.waitFor(t, i+2)
				at := got[len(got)-1].at
				total[i], afterCommit[i] = at.Sub(began), max(at.Sub(committed), 0)
			}
			require.NoError(t, r.stop(t))
			describe := func(ds []time.Duration) string {
				slices.Sort(ds)
				round := func(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }
				return fmt.Sprintf("min %s, median %s, p90 %s, max %s", round(ds[0]), round(ds[samples/2]), round(ds[samples*9/10]), round(ds[samples-1]))
			}
			t.Logf("relay latency, %s, %d messages, poll interval %s: from the Publish in the transaction %s; from the commit %s",
				tc.name, samples, outbox.DefaultPollInterval, describe(total), describe(afterCommit))
			require.Less(t, afterCommit[samples/2], outbox.DefaultPollInterval/5, "the median latency after the commit is not well below the poll interval")
		})
	}
}
