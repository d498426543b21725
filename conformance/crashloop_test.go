package conformance

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
)

// knownDefects names the environment variable that runs the tests of known defects, which fail
// until the defect is fixed.
const knownDefects = "ONCEFLOW_KNOWN_DEFECTS"

// TestKnownDefect_CrashLoopDeadLettersItsNeighbours: a message that kills its consumer every
// time takes with it, at each death, the messages that the consumer had received with it: those
// waiting behind it are not processed, and those processed just before it lose their
// acknowledgement. Where the broker counts deliveries (the SQL, SQLite and Redis queues, a
// RabbitMQ quorum queue, mem), each of those deliveries counts. A good message delivered with
// the crash-loop message each time (an SQLite queue leases a consumer's messages together, so
// they come back together) reaches the delivery limit with it, and is dead-lettered with
// "delivery limit reached after 3 deliveries: the last one ended without an outcome": never
// processed, or processed and acknowledged in vain each time (the dead letter is then of a
// message whose effect is committed, since the limit is checked before duplicate detection).
//
// The router cannot tell a delivery that died in the processor from one that waited behind it,
// or whose acknowledgement died with the process: the limit counts deliveries, where a crash
// loop needs a count of processing attempts that did not end (written when a delivery starts
// its processing, and cleared by its outcome). The Poison scenario publishes its crash-loop
// message apart from the others for this reason.
func TestKnownDefect_CrashLoopDeadLettersItsNeighbours(t *testing.T) {
	if os.Getenv(knownDefects) == "" {
		t.Skipf("known defect (see the test's comment); %s=1 runs it", knownDefects)
	}
	for _, tc := range []struct {
		name   string
		broker func(t *testing.T) string
	}{
		{"sqlite", func(t *testing.T) string { return "sqlite://" + filepath.Join(t.TempDir(), "queue.db") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			brokerURL := tc.broker(t)
			f := newFixture(t, Setup{
				BrokerURL:   func(testing.TB) string { return brokerURL },
				DatabaseURL: func(t testing.TB) string { return testsvc.SQLiteURL(t) },
			}, DefaultFeatures(brokerURL), PerMessage)
			_, err := f.db.Exec(`CREATE TABLE ` + poisonTable + ` (handler VARCHAR(64) NOT NULL, message_id VARCHAR(255) NOT NULL,
				amount INTEGER NOT NULL, applied_at BIGINT NOT NULL)`)
			require.NoError(t, err)
			f.migrateRouterTables()
			b := f.openBroker(f.brokerURL)
			dead := f.collectDeadLetters(b)
			topic := f.topic("in")
			p := f.newPool("poison", topic, 2)
			p.start()
			p.waitReady()

			crash := f.id("crash")
			neighbours := []string{f.id("neighbour1"), f.id("neighbour2"), f.id("neighbour3")}
			f.publish(b, topic, crash, `{"amount":1,"crash":true}`)
			for i, id := range neighbours {
				f.publish(b, topic, id, fmt.Sprintf(`{"amount":%d}`, i))
			}
			dls := func() map[string][]string {
				out := map[string][]string{}
				for _, m := range dead.all() {
					out[m.UUID] = append(out[m.UUID], m.Metadata.Get(messagedata.HeaderDeadLetterReason))
				}
				return out
			}
			f.eventually(func() bool {
				require.NoError(t, p.failure())
				d := dls()
				done := len(d[crash]) == 1
				for _, id := range neighbours {
					done = done && (len(d[id]) > 0 || f.poisonCounts("poison")[id] > 0)
				}
				return done
			}, "the crash-loop message was not dead-lettered")
			time.Sleep(500 * time.Millisecond)

			effects := f.poisonCounts("poison")
			for _, id := range neighbours {
				require.Empty(t, dls()[id], "%s, received with the crash-loop message, was dead-lettered (%+v, %d effects)", id, p.tally.get(id), effects[id])
				require.Equal(t, 1, effects[id], "%s, received with the crash-loop message, has one effect", id)
			}
		})
	}
}
