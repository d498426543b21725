package sqlitequeue_test

import (
	"context"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// BenchmarkSubscriber_PublishThenConsume publishes n messages to a fresh queue file and then
// consumes and acknowledges all of them, timing the consumption (from Subscribe until the
// group's backlog is empty, so until the acknowledgements are committed) and reporting msgs/s.
// "lease" is the queue's subscriber; "watermill-sql" is watermill-sql's subscriber over the same
// tables with the queue's adapters, the core of the subscriber the queue had before leases
// (which added a savepoint per delivery and turn-taking with publishers, and was slower still).
//
// Two consumers: "ack" acknowledges each message as soon as it arrives, one after the other;
// "work-1ms" runs each message in a goroutine of its own that takes 1 ms before it acknowledges,
// as a watermill router does with a handler that writes a database.
func BenchmarkSubscriber_PublishThenConsume(b *testing.B) {
	const n = 2000
	subscribers := []struct {
		name string
		make func(b *testing.B, q *sqlitequeue.Queue) message.Subscriber
	}{
		{"lease", func(b *testing.B, q *sqlitequeue.Queue) message.Subscriber {
			sub, err := q.Subscriber()
			if err != nil {
				b.Fatal(err)
			}
			return sub
		}},
		{"watermill-sql", func(b *testing.B, q *sqlitequeue.Queue) message.Subscriber {
			cfg := q.Config()
			sub, err := wsql.NewSubscriber(q.DB().DB.DB, wsql.SubscriberConfig{
				ConsumerGroup:  cfg.ConsumerGroup,
				PollInterval:   cfg.PollInterval,
				ResendInterval: cfg.ResendInterval,
				RetryInterval:  cfg.RetryInterval,
				AckDeadline:    &cfg.AckDeadline,
				SchemaAdapter:  sqlitequeue.SchemaAdapter{BatchSize: cfg.BatchSize},
				OffsetsAdapter: sqlitequeue.OffsetsAdapter{},
			}, watermill.NopLogger{})
			if err != nil {
				b.Fatal(err)
			}
			return sub
		}},
	}
	consumers := []struct {
		name string
		work time.Duration
	}{
		{"ack", 0},
		{"work-1ms", time.Millisecond},
	}
	for _, s := range subscribers {
		for _, c := range consumers {
			b.Run(s.name+"/"+c.name, func(b *testing.B) {
				var consumed time.Duration
				for i := 0; i < b.N; i++ {
					consumed += consumeOnce(b, s.make, n, c.work)
				}
				b.ReportMetric(float64(n*b.N)/consumed.Seconds(), "msgs/s")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// consumeOnce publishes n messages to a fresh queue file and returns how long the subscriber
// that newSub makes took to deliver all of them and have them acknowledged.
func consumeOnce(b *testing.B, newSub func(*testing.B, *sqlitequeue.Queue) message.Subscriber, n int, work time.Duration) time.Duration {
	b.Helper()
	ctx := context.Background()
	q, err := sqlitequeue.Open(ctx, filepath.Join(b.TempDir(), "queue.db"), sqlitequeue.Config{ConsumerGroup: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = q.Close() }()
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
	}
	if err := q.Publisher().Publish("bench", msgs...); err != nil {
		b.Fatal(err)
	}
	sub := newSub(b, q)
	defer func() { _ = sub.Close() }()

	start := time.Now()
	in, err := sub.Subscribe(ctx, "bench")
	if err != nil {
		b.Fatal(err)
	}
	acked := make(chan struct{}, n)
	seen := make(map[string]bool, n)
	for len(seen) < n {
		var m *message.Message
		select {
		case m = <-in:
		case <-time.After(30 * time.Second):
			b.Fatalf("%d of %d messages consumed within 30 s", len(seen), n)
		}
		if seen[m.UUID] {
			m.Ack()
			continue
		}
		seen[m.UUID] = true
		if work == 0 {
			m.Ack()
			acked <- struct{}{}
			continue
		}
		go func() {
			time.Sleep(work)
			m.Ack()
			acked <- struct{}{}
		}()
	}
	for range n {
		<-acked
	}
	// Consumed means acknowledged durably: wait until the group's backlog is empty.
	for {
		left, err := q.Backlog(ctx, "bench", "bench")
		if err != nil {
			b.Fatal(err)
		}
		if left == 0 {
			break
		}
		if time.Since(start) > time.Minute {
			b.Fatalf("backlog of %d after a minute", left)
		}
		time.Sleep(time.Millisecond)
	}
	return time.Since(start)
}
