package sqlqueue_test

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// benchMessages is how many messages each round publishes, then consumes and acks.
const benchMessages = 2000

// BenchmarkSubscriber_ConsumeAndAck publishes benchMessages messages to a fresh topic, then
// consumes and acks them all, with this package's subscriber (sqlqueue; sqlqueue-direct
// subscribes as onceflow's router does, and calls redelivery.Settle after each ack) and with
// watermill-sql's, side by side, on PostgreSQL and MariaDB, with the same prefetch (watermill-sql's batch size) and poll
// interval. Each message is processed and acked in a goroutine of its own, as watermill's
// router does, at once (work=0s: the subscribers' own cost) or after 1 ms (a handler's
// transaction). It reports msgs/s of the consuming, and the CPU time of the test process per
// message meanwhile (cpu-µs/msg); publishing is not timed.
//
//	CI=true go test -run '^$' -bench BenchmarkSubscriber -benchtime 3x ./broker/sqlqueue/
func BenchmarkSubscriber_ConsumeAndAck(b *testing.B) {
	for _, d := range []struct {
		name string
		url  func(testing.TB) string
	}{
		{"postgres", testsvc.PostgresSchemaURL},
		{"mysql", testsvc.MySQLDatabaseURL},
	} {
		b.Run(d.name, func(b *testing.B) {
			db := openDB(b, d.url(b))
			for _, work := range []time.Duration{0, time.Millisecond} {
				for _, prefetch := range []int{10, 100} {
					cfg := sqlqueue.Config{Prefetch: prefetch, PollInterval: 10 * time.Millisecond}
					q, err := sqlqueue.New(db.DB.DB, db.Dialect, cfg)
					require.NoError(b, err)
					name := fmt.Sprintf("work=%s/prefetch=%d", work, prefetch)
					b.Run(name+"/sqlqueue", func(b *testing.B) {
						benchConsume(b, q, work, false, func() message.Subscriber { return q.Subscriber() })
					})
					b.Run(name+"/sqlqueue-direct", func(b *testing.B) {
						benchConsume(b, q, work, true, func() message.Subscriber { return q.Subscriber() })
					})
					b.Run(name+"/watermill-sql", func(b *testing.B) {
						benchConsume(b, q, work, false, func() message.Subscriber { return watermillSubscriber(b, db, q, prefetch) })
					})
				}
			}
		})
	}
}

// watermillSubscriber is watermill-sql's subscriber over q's tables, configured as the broker
// configured it before this package: batches of prefetch messages.
func watermillSubscriber(b *testing.B, db *sqldb.DB, q *sqlqueue.Queue, prefetch int) message.Subscriber {
	var schema wsql.SchemaAdapter
	var offsets wsql.OffsetsAdapter
	if db.Dialect == sqldb.Postgres {
		schema = wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }, SubscribeBatchSize: prefetch}
		offsets = wsql.DefaultPostgreSQLOffsetsAdapter{}
	} else {
		schema = wsql.DefaultMySQLSchema{GeneratePayloadType: func(string) string { return "LONGBLOB" }, SubscribeBatchSize: prefetch}
		offsets = wsql.DefaultMySQLOffsetsAdapter{}
	}
	s, err := wsql.NewSubscriber(db.DB.DB, wsql.SubscriberConfig{
		ConsumerGroup:  q.Config().ConsumerGroup,
		PollInterval:   q.Config().PollInterval,
		ResendInterval: time.Millisecond,
		SchemaAdapter:  schema,
		OffsetsAdapter: offsets,
	}, nil)
	require.NoError(b, err)
	return s
}

// benchConsume times the consuming of benchMessages messages by a subscriber that
// newSubscriber makes; each message takes work to process before its ack. With direct it
// subscribes as a consumer that settles directly.
func benchConsume(b *testing.B, q *sqlqueue.Queue, work time.Duration, direct bool, newSubscriber func() message.Subscriber) {
	ctx := context.Background()
	subCtx := ctx
	if direct {
		subCtx = redelivery.WithDirectSettle(ctx)
	}
	pub, err := q.NewPublisher()
	require.NoError(b, err)
	var consumed, cpu time.Duration
	for b.Loop() {
		b.StopTimer()
		tp := topic()
		require.NoError(b, q.EnsureTopic(ctx, tp))
		msgs := make([]*message.Message, benchMessages)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(`{"n":1}`))
		}
		for i := 0; i < len(msgs); i += 500 {
			require.NoError(b, pub.Publish(tp, msgs[i:i+500]...))
		}
		sub := newSubscriber()
		b.StartTimer()

		start, startCPU := time.Now(), processCPU(b)
		ch, err := sub.Subscribe(subCtx, tp)
		require.NoError(b, err)
		for range benchMessages {
			m := receive(b, ch)
			go func() {
				if work > 0 {
					time.Sleep(work) // a handler's transaction, say
				}
				m.Ack()
				redelivery.Settle(m)
			}()
		}
		require.NoError(b, sub.Close())
		consumed += time.Since(start)
		cpu += processCPU(b) - startCPU
	}
	b.ReportMetric(float64(b.N*benchMessages)/consumed.Seconds(), "msgs/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N*benchMessages), "cpu-µs/msg")
}

// processCPU returns the CPU time the test process has used, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	require.NoError(b, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
