package onceflow_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/mem"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// processCPU is the CPU time the process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkRouter_Drain drains a backlog of b.N messages from an in-process broker (prefetch
// 128 per subscription) into PostgreSQL through a Router, with a batch processor and with a
// per-message processor under group commit, both writing nothing but their dedup rows: what
// remains is the router's, the chain's and group commit's own cost per message (cpu-µs/msg:
// the process's CPU time, which includes the broker's goroutines).
func BenchmarkRouter_Drain(b *testing.B) {
	for _, variant := range []string{"batch-gc", "exactlyonce-gc"} {
		for _, c := range []int{1, 16} {
			b.Run(fmt.Sprintf("%s/c%d", variant, c), func(b *testing.B) {
				db := testsvc.Postgres(b)
				hub := mem.NewHub()
				b.Cleanup(func() { _ = hub.Close() })
				sub, err := mem.NewSubscriber(hub, mem.Config{ConsumerGroup: "bench", Prefetch: 128})
				require.NoError(b, err)
				drain(b, db, sub, hub, variant, c)
			})
		}
	}
}

// BenchmarkRouter_PerMessage drains a backlog of b.N messages from the in-memory test broker
// (internal/brokertest, prefetch 128 per subscription) into SQLite and PostgreSQL through a
// Router with the OpenTelemetry no-op defaults: with a batch processor under group commit, a
// per-message processor under group commit, and a per-message processor with a transaction of
// its own (ExactlyOnce). The processors write nothing but their dedup rows, so allocs/op and
// cpu-µs/msg are the router's, the chain's and the broker's own per message.
func BenchmarkRouter_PerMessage(b *testing.B) {
	for _, d := range testsvc.Databases()[:2] { // SQLite and PostgreSQL
		for _, variant := range []string{"batch-gc", "exactlyonce-gc", "exactlyonce"} {
			for _, c := range []int{1, 16} {
				b.Run(fmt.Sprintf("%s/%s/c%d", d.Name, variant, c), func(b *testing.B) {
					db := d.Open(b)
					broker := brokertest.New()
					broker.Prefetch = 128
					b.Cleanup(func() { _ = broker.Close() })
					drain(b, db, broker.Subscriber(), broker, variant, c)
				})
			}
		}
	}
}

// drain publishes b.N messages to pub and times a Router that consumes them from sub into db
// with variant (batch-gc, exactlyonce-gc or exactlyonce) at concurrency c.
func drain(b *testing.B, db *sqldb.DB, sub message.Subscriber, pub message.Publisher, variant string, c int) {
	var done atomic.Int64
	all := make(chan struct{})
	count := func(n int) {
		if done.Add(int64(n)) == int64(b.N) {
			close(all)
		}
	}
	h := onceflow.Handler{Name: "drain", Topic: "drain", Subscriber: sub, DB: db, QoS: onceflow.ExactlyOnce, Concurrency: c}
	switch variant {
	case "batch-gc":
		h.BatchProcessor = processor.BatchFunc(func(_ context.Context, msgs []*messagedata.MessageData) error {
			count(len(msgs))
			return nil
		})
	case "exactlyonce-gc", "exactlyonce":
		h.GroupCommit.Disabled = variant == "exactlyonce"
		h.Processor = processor.Func(func(context.Context, *messagedata.MessageData) error {
			count(1)
			return nil
		})
	default:
		b.Fatalf("unknown variant %q", variant)
	}
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: pub, PurgeInterval: -1})
	require.NoError(b, err)
	require.NoError(b, r.AddHandler(h))
	require.NoError(b, r.Migrate(context.Background()))
	msgs := make([]*message.Message, b.N)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("m-%d", i), make([]byte, 1024))
	}
	published := make(chan error, 1)
	go func() { published <- pub.Publish("drain", msgs...) }() // a bounded topic takes the rest as the router drains it
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu := time.Now(), processCPU()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	<-all
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
	b.ReportMetric(float64((processCPU()-cpu).Microseconds())/float64(b.N), "cpu-µs/msg")
	cancel()
	require.NoError(b, <-ran)
	require.NoError(b, <-published)
}
