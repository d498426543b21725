package onceflow_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// BenchmarkSQLQueueExactlyOnce drains 2,000 messages of the PostgreSQL and MySQL queues in the
// handler's own database, ExactlyOnce at Concurrency 8, with a dedup row per message
// ("dedup") and with the acknowledgement in the handler's transaction ("ack-in-tx"),
// side by side. It reports msgs/s; publishing is not timed.
//
//	CI=true go test -run '^$' -bench BenchmarkSQLQueueExactlyOnce -benchtime 3x .
func BenchmarkSQLQueueExactlyOnce(b *testing.B) {
	const messages = 2000
	for _, d := range testsvc.Databases()[1:] {
		b.Run(d.Name, func(b *testing.B) {
			ctx := context.Background()
			url := d.URL(b)
			db, err := sqldb.Open(ctx, url)
			require.NoError(b, err)
			b.Cleanup(func() { _ = db.Close() })
			_, err = db.Exec(`CREATE TABLE effects (message_id VARCHAR(255) NOT NULL, note VARCHAR(255) NOT NULL)`)
			require.NoError(b, err)
			for _, mode := range []string{"dedup", "ack-in-tx"} {
				b.Run(mode, func(b *testing.B) {
					var total time.Duration
					for i := range b.N {
						bk, err := broker.Open(ctx, url, broker.Options{ConsumerGroup: "bench", Prefetch: 64})
						require.NoError(b, err)
						topic := testsvc.UniqueName("bench")
						pub := bk.Publisher()
						for n := range messages {
							require.NoError(b, pub.Publish(topic, message.NewMessage(fmt.Sprintf("%s-%d-%d", mode, i, n), []byte("x"))))
						}
						sub, err := bk.Subscriber()
						require.NoError(b, err)
						r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: pub, PurgeInterval: -1})
						require.NoError(b, err)
						done := make(chan struct{}, messages)
						h := onceflow.Handler{Name: topic, Topic: topic, DB: db, Subscriber: sub, QoS: onceflow.ExactlyOnce, Concurrency: 8,
							Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
								if err := applyEffect(ctx, msg); err != nil {
									return err
								}
								done <- struct{}{}
								return nil
							})}
						if mode == "ack-in-tx" {
							h.Dedup.Mode = middleware.DedupAckInTransaction
						}
						require.NoError(b, r.AddHandler(h))
						runCtx, cancel := context.WithCancel(ctx)
						stopped := make(chan error, 1)
						start := time.Now()
						go func() { stopped <- r.Run(runCtx) }()
						for range messages {
							<-done
						}
						total += time.Since(start)
						cancel()
						require.NoError(b, <-stopped)
						require.NoError(b, bk.Close())
					}
					b.ReportMetric(float64(messages*b.N)/total.Seconds(), "msgs/s")
				})
			}
		})
	}
}
