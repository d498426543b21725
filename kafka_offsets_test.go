package onceflow_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// Two consumers of one Kafka group, the second joining while the first has records in flight
// and the first leaving while the second has: each rebalance moves partitions whose records
// are being applied. With duplicate detection by offset, every record has exactly one effect,
// and the positions table holds one row per partition.
func TestExactlyOnceByOffset_KafkaRebalancesApplyEachRecordOnce(t *testing.T) {
	const records = 300
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		if d.Name == "sqlite" {
			t.Skip("two routers on one SQLite file take turns at its write lock: the rebalance is shown on the servers")
		}
		f := newFixture(t, d)
		ctx := context.Background()
		url := kafkatest.URL(t, "partitions=4")
		group, topic := testsvc.UniqueName("g"), testsvc.UniqueName("t")
		open := func() *broker.Broker {
			b, err := broker.Open(ctx, url, broker.Options{ConsumerGroup: group, AckTimeout: 3 * time.Second, Prefetch: 32})
			require.NoError(t, err)
			t.Cleanup(func() { _ = b.Close() })
			return b
		}
		pub := open()
		start := func() (*onceflow.Router, context.CancelFunc) {
			b := open()
			sub, err := b.Subscriber()
			require.NoError(t, err)
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1, CloseTimeout: 10 * time.Second})
			require.NoError(t, err)
			require.NoError(t, r.AddHandler(onceflow.Handler{Name: "effects", Topic: topic, DB: f.db, Subscriber: sub, QoS: onceflow.ExactlyOnce,
				Concurrency: 1, Dedup: onceflow.DedupConfig{ByOffset: true},
				Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					time.Sleep(2 * time.Millisecond) // records stay in flight across the rebalances
					return applyEffect(ctx, msg)
				})}))
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- r.Run(rctx) }()
			<-r.Running()
			var once sync.Once
			var runErr error
			stop := func() {
				once.Do(func() { cancel(); runErr = <-done })
				require.NoError(t, runErr)
			}
			t.Cleanup(stop)
			return r, stop
		}
		for i := range records {
			require.NoError(t, pub.Publisher().Publish(topic, message.NewMessage(fmt.Sprintf("r-%03d", i), []byte("x"))))
		}
		applied := func() int {
			var n int
			require.NoError(t, f.db.Get(&n, `SELECT COUNT(DISTINCT message_id) FROM effects`))
			return n
		}
		_, stopFirst := start()
		testsvc.Eventually(t, 30*time.Second, func() bool { return applied() >= records/4 }, "the first consumer applied nothing")
		start() // joins: the group rebalances while the first has records in flight
		testsvc.Eventually(t, 30*time.Second, func() bool { return applied() >= records/2 }, "no progress after the second joined")
		stopFirst() // leaves: its partitions move to the second
		testsvc.Eventually(t, 60*time.Second, func() bool { return applied() == records }, "not every record was applied")

		var effects, rows int
		require.NoError(t, f.db.Get(&effects, `SELECT COUNT(*) FROM effects`))
		require.Equal(t, records, effects, "each record has exactly one effect")
		require.NoError(t, f.db.Get(&rows, `SELECT COUNT(*) FROM onceflow_positions WHERE handler = 'effects'`))
		require.LessOrEqual(t, rows, 4, "one row per partition")
	})
}
