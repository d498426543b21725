package conformance

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
)

// TestCrashLoopMessageTakesNoNeighbourWithIt: a message that kills its consumer every time
// takes with it, at each death, the messages that the consumer had received with it: those
// waiting behind it are not processed, and those processed just before it may lose their
// acknowledgement. Where the broker counts deliveries (the SQL, SQLite and Redis queues, a
// RabbitMQ quorum queue, mem) or the router counts them (a RabbitMQ classic queue), each of
// those deliveries counts; an SQLite queue leases a consumer's messages together, so they come
// back together. The router runs a message alone from its second redelivery and counts the
// deliveries whose processing began (its first redelivery, run in a group, only if it fails): the
// crash-loop message reaches the delivery limit and is dead-lettered with "delivery limit
// reached after 3 deliveries: the last one ended without an outcome", and each
// neighbour is processed once and never dead-lettered (one over the limit whose effect is
// committed is acknowledged as a duplicate).
func TestCrashLoopMessageTakesNoNeighbourWithIt(t *testing.T) {
	for _, tc := range []struct {
		name     string
		broker   func(t *testing.T) string
		database func(t testing.TB) string
	}{
		{"sqlite", func(t *testing.T) string { return "sqlite://" + filepath.Join(t.TempDir(), "queue.db") }, testsvc.SQLiteURL},
		{"rabbitmq", func(t *testing.T) string { return testsvc.AMQPURL(t) }, testsvc.PostgresSchemaURL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			brokerURL := tc.broker(t)
			f := newFixture(t, Setup{
				BrokerURL:   func(testing.TB) string { return brokerURL },
				DatabaseURL: tc.database,
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
