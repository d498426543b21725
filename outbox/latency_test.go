package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/outbox"
)

// A relay hears of each commit instead of waiting for its next poll: from the Outbox of its
// own process on every dialect, and on PostgreSQL from a notification wherever it runs (a relay
// on a pool of another URL stands for one in another process). Its poll interval is an hour
// here, so a message reaches the destination within the test only if the relay was woken. The
// latencies are logged; their speed is not asserted (a loaded machine makes any bound flaky).
func TestRelay_IsWokenByEachCommitWithoutWaitingForItsPoll(t *testing.T) {
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
			cfg.PollInterval = time.Hour
			r := start(t, cfg)
			e.commitN(t, "warm-up", 1)
			rec.waitFor(t, 1)

			const samples = 10
			afterCommit := make([]time.Duration, samples) // commit returned -> destination
			for i := range afterCommit {
				in := fmt.Sprintf("order-%03d", i)
				require.NoError(t, e.process(context.Background(), in, nil, message.NewMessage(outbox.DerivedID(in, "shipped"), []byte(in))))
				committed := time.Now()
				got := rec.waitFor(t, i+2)
				require.Len(t, got, i+2, "one message per commit")
				afterCommit[i] = max(got[len(got)-1].at.Sub(committed), 0)
			}
			require.NoError(t, r.stop(t))
			slices.Sort(afterCommit)
			t.Logf("relay latency after the commit, %s, %d messages, poll interval 1h: median %s, max %s",
				tc.name, samples, afterCommit[samples/2].Round(10*time.Microsecond), afterCommit[samples-1].Round(10*time.Microsecond))
		})
	}
}
