package conformance

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
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

// TestKnownDefect_DeadLetterPublishedAgainWhenItsAckIsLost: a message that fails permanently is
// published to the dead-letter topic and then acknowledged; when the acknowledgement is lost
// (its consumer dies, or its connection drops, between the two) the broker delivers the message
// again and it is dead-lettered again. Nothing records that it was: dead letters are at least
// once, where the rest of a handler's outcomes are exactly once. verify saw one on RabbitMQ with
// PostgreSQL (a poison message dead-lettered twice, in a run with five connection cuts).
//
// Publishing the dead letter through the handler's outbox, with its id recorded in the dedup
// table in the same transaction, would make the redelivery a duplicate; on NATS, JetStream drops
// the second publish of the dead letter's id within its duplicate window.
func TestKnownDefect_DeadLetterPublishedAgainWhenItsAckIsLost(t *testing.T) {
	if os.Getenv(knownDefects) == "" {
		t.Skipf("known defect (see the test's comment); %s=1 runs it", knownDefects)
	}
	brokerURL := "mem://" + testsvc.UniqueName("deadletter")
	f := newFixture(t, Setup{
		BrokerURL:   func(testing.TB) string { return brokerURL },
		DatabaseURL: func(t testing.TB) string { return testsvc.SQLiteURL(t) },
	}, DefaultFeatures(brokerURL), PerMessage)
	b := f.openBroker(f.brokerURL)
	dead := f.collectDeadLetters(b)
	topic := f.topic("in")

	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(), DeadLetterTopic: f.dlq, Logger: f.logger, PurgeInterval: -1, CloseTimeout: 5 * time.Second,
	})
	require.NoError(t, err)
	var lost sync.Once
	// Outside "deadletter": the dead letter is out, and the acknowledgement is lost once.
	interceptor(t, r, "lose-first-ack", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			lose := false
			if processor.IsDeadLettered(err) {
				lost.Do(func() { lose = true })
			}
			if lose {
				return errAckLost
			}
			return err
		})
	})
	sub, err := b.Subscriber()
	require.NoError(t, err)
	p := newProbe(t)
	h := f.handler(handlerSpec{Name: "effects", Topic: topic, Processor: processor.Func(func(context.Context, *messagedata.MessageData) error {
		return processor.Permanent(errors.New("rejected by a business rule"))
	})}, p.wrap("effects", sub))
	h.Interceptors = []string{onceflow.InterceptorTracing, onceflow.InterceptorMetrics, "lose-first-ack", onceflow.InterceptorDeadLetter,
		onceflow.InterceptorRecover, onceflow.InterceptorRetry, onceflow.InterceptorTransaction, onceflow.InterceptorDeduplicate}
	require.NoError(t, r.AddHandler(h))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-r.Running()

	id := f.id("rejected")
	f.publish(b, topic, id, "x")
	f.waitAcks(p, "effects", id, 1)
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, deliveryCounts{Deliveries: 2, Acks: 1, Nacks: 1}, p.get("effects", id), "the delivery whose ack was lost, then its redelivery")
	require.Len(t, dead.all(), 1, "dead-lettered once, although delivered twice")
}
