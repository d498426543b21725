package onceflow_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// BenchmarkKafkaExactlyOnce drains the same number of records in 4 partitions of a Kafka
// cluster (kfake, in process) into PostgreSQL, ExactlyOnce at Concurrency 4, with a dedup row
// per message ("dedup") and with duplicate detection by offset ("offset"), one transaction per
// message (2,000 records a round), with group commit and with a batch processor (10,000). Past
// 3 rounds the drains shrink, so that -benchtime 100x (BENCH_QUICK) stays a short run. Each
// round drains records with each, one after the other, in alternating order, so that both see
// the same moment of a noisy machine; it reports the msgs/s of each, offset/dedup, their ratio,
// and the CPU time of this process per message (the router, the in-process Kafka cluster and
// the publisher, not the database server), which the machine's other load disturbs less. The
// consumer group settles on a few records before the clock starts (see drain).
//
//	CI=true go test -run '^$' -bench BenchmarkKafkaExactlyOnce -benchtime 1x .
func BenchmarkKafkaExactlyOnce(b *testing.B) {
	brokers := kafkatest.Brokers(b)
	url := kafkatest.URLOf(brokers, "partitions=4")
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	require.NoError(b, err)
	defer cl.Close()
	admin := kadm.NewClient(cl)
	db := testsvc.Databases()[1].Open(b)
	_, err = db.Exec(`CREATE TABLE effects (message_id VARCHAR(255) NOT NULL, note VARCHAR(255) NOT NULL)`)
	require.NoError(b, err)
	apply := func(ctx context.Context, msg *messagedata.MessageData) error {
		tx, _ := middleware.CurrentTx(ctx)
		_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO effects (message_id, note) VALUES (?, ?)`), msg.ID, "x")
		return err
	}
	batch := processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
		tx, _ := middleware.CurrentTx(ctx)
		q, args := `INSERT INTO effects (message_id, note) VALUES `, make([]any, 0, 2*len(msgs))
		for i, msg := range msgs {
			if i > 0 {
				q += ", "
			}
			q += "(?, ?)"
			args = append(args, msg.ID, "x")
		}
		_, err := tx.ExecContext(ctx, tx.Rebind(q), args...)
		return err
	})

	// drain times a router draining records with h: it starts the router on a few records and
	// waits for its consumer group to settle (members join one after the other, and each join
	// stops the group's consumption for a rebalance, which is no rate of either mode), then
	// publishes the records in batches, much faster than either mode applies them, and times
	// from the first batch to the last record applied.
	drain := func(b *testing.B, records int, set func(h *onceflow.Handler)) (took, cpu time.Duration) {
		ctx := context.Background()
		group, topic := testsvc.UniqueName("g"), testsvc.UniqueName("t")
		bk, err := broker.Open(ctx, url, broker.Options{ConsumerGroup: group, Prefetch: 256})
		require.NoError(b, err)
		defer func() { _ = bk.Close() }()
		pub := bk.Publisher()
		const warm = 100
		publish := func(from, to int) {
			for start := from; start < to; start += 1000 {
				batch := make([]*message.Message, 0, 1000)
				for n := start; n < min(start+1000, to); n++ {
					batch = append(batch, message.NewMessage(fmt.Sprintf("%s-%d", topic, n), []byte("x")))
				}
				require.NoError(b, pub.Publish(topic, batch...))
			}
		}
		publish(0, warm)
		sub, err := bk.Subscriber()
		require.NoError(b, err)
		r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: pub, PurgeInterval: -1})
		require.NoError(b, err)
		done := make(chan struct{}, warm+records)
		h := onceflow.Handler{Name: topic, Topic: topic, DB: db, Subscriber: sub, QoS: onceflow.ExactlyOnce, Concurrency: 4}
		set(&h)
		counted := func(ctx context.Context, msg *messagedata.MessageData) error {
			if err := apply(ctx, msg); err != nil {
				return err
			}
			done <- struct{}{}
			return nil
		}
		if h.BatchProcessor != nil {
			h.BatchProcessor = processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
				if err := batch(ctx, msgs); err != nil {
					return err
				}
				for range msgs {
					done <- struct{}{}
				}
				return nil
			})
		} else {
			h.Processor = processor.Func(counted)
		}
		require.NoError(b, r.AddHandler(h))
		runCtx, cancel := context.WithCancel(ctx)
		stopped := make(chan error, 1)
		go func() { stopped <- r.Run(runCtx) }()
		for range warm {
			<-done
		}
		waitSettled(b, admin, group, h.Concurrency)
		start, cpu0 := time.Now(), processCPU()
		publish(warm, warm+records)
		for range records {
			<-done
		}
		took, cpu = time.Since(start), processCPU()-cpu0
		cancel()
		require.NoError(b, <-stopped)
		var n int
		require.NoError(b, db.Get(&n, db.Rebind(`SELECT COUNT(*) FROM effects WHERE message_id LIKE ?`), topic+"-%"))
		require.Equal(b, warm+records, n, "each record applied once")
		return took, cpu
	}

	for _, shape := range []struct {
		name    string
		records int
		set     func(h *onceflow.Handler)
	}{
		{"per-message", 2000, func(h *onceflow.Handler) { h.GroupCommit.Disabled = true }},
		{"group-commit", 10000, func(*onceflow.Handler) {}},
		{"batch", 10000, func(h *onceflow.Handler) { h.BatchProcessor = batch }},
	} {
		b.Run(shape.name, func(b *testing.B) {
			records := max(shape.records*3/max(b.N, 3), 100)
			var dedupTime, offsetTime, dedupCPU, offsetCPU time.Duration
			for i := range b.N {
				modes := []bool{false, true}
				if i%2 == 1 {
					modes = []bool{true, false}
				}
				for _, byOffset := range modes {
					took, cpu := drain(b, records, func(h *onceflow.Handler) {
						shape.set(h)
						if byOffset {
							h.Dedup.Mode = middleware.DedupByOffset
						}
					})
					if byOffset {
						offsetTime, offsetCPU = offsetTime+took, offsetCPU+cpu
					} else {
						dedupTime, dedupCPU = dedupTime+took, dedupCPU+cpu
					}
				}
			}
			dedupRate := float64(records*b.N) / dedupTime.Seconds()
			offsetRate := float64(records*b.N) / offsetTime.Seconds()
			b.ReportMetric(dedupRate, "dedup-msgs/s")
			b.ReportMetric(offsetRate, "offset-msgs/s")
			b.ReportMetric(offsetRate/dedupRate, "offset/dedup")
			b.ReportMetric(float64(dedupCPU.Microseconds())/float64(records*b.N), "dedup-cpu-us/msg")
			b.ReportMetric(float64(offsetCPU.Microseconds())/float64(records*b.N), "offset-cpu-us/msg")
		})
	}
}

// waitSettled waits until the consumer group has members members, each assigned partitions,
// and is stable.
func waitSettled(b *testing.B, admin *kadm.Client, group string, members int) {
	b.Helper()
	testsvc.Eventually(b, 30*time.Second, func() bool {
		return kafkatest.Settled(context.Background(), admin, group, members)
	}, "consumer group %s did not settle with %d members", group, members)
}
