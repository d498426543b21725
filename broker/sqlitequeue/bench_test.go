package sqlitequeue_test

import (
	"context"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// BenchmarkSubscriber_PublishThenConsume publishes n messages to a fresh queue file and then
// consumes and acknowledges all of them, timing the consumption (from Subscribe until the
// group's backlog is empty, so until the acknowledgements are committed) and reporting msgs/s.
// "lease" is the queue's subscriber; "watermill-sql" is watermill-sql's subscriber over the same
// tables with the queue's adapters, the core of the subscriber the queue had before leases
// (which added a savepoint per delivery and turn-taking with publishers, and was slower still).
//
// "lease-direct" is the queue's subscriber with a consumer that settles each message itself
// (redelivery.Settle after its ack), as onceflow's router does, and a window of 128 (the
// benchmark command's prefetch).
//
// Two consumers: "ack" acknowledges each message as soon as it arrives, one after the other;
// "work-1ms" runs each message in a goroutine of its own that takes 1 ms before it acknowledges,
// as a watermill router does with a handler that writes a database.
//
// Besides msgs/s it reports cpu-µs/msg: the process's CPU time (user and system) over the
// consumption, per message, which the machine's other work sways less than the rate.
func BenchmarkSubscriber_PublishThenConsume(b *testing.B) {
	const n = 2000
	subscribers := []struct {
		name   string
		window int
		direct bool
		make   func(b *testing.B, q *sqlitequeue.Queue) message.Subscriber
	}{
		{"lease", 0, false, func(b *testing.B, q *sqlitequeue.Queue) message.Subscriber {
			sub, err := q.Subscriber()
			if err != nil {
				b.Fatal(err)
			}
			return sub
		}},
		{"lease-direct", 128, true, func(b *testing.B, q *sqlitequeue.Queue) message.Subscriber {
			sub, err := q.Subscriber()
			if err != nil {
				b.Fatal(err)
			}
			return sub
		}},
		{"watermill-sql", 0, false, func(b *testing.B, q *sqlitequeue.Queue) message.Subscriber {
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
				var consumed, cpu time.Duration
				for i := 0; i < b.N; i++ {
					wall, used := consumeOnce(b, s.make, s.window, s.direct, n, c.work)
					consumed += wall
					cpu += used
				}
				b.ReportMetric(float64(n*b.N)/consumed.Seconds(), "msgs/s")
				b.ReportMetric(float64(cpu.Microseconds())/float64(n*b.N), "cpu-µs/msg")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// consumeOnce publishes n messages to a fresh queue file and returns how long the subscriber
// that newSub makes took to deliver all of them and have them acknowledged, and the CPU time
// the process used meanwhile. window is the queue's BatchSize (0: the default); with direct,
// the consumer subscribes with redelivery.WithDirectSettle and settles each message.
func consumeOnce(b *testing.B, newSub func(*testing.B, *sqlitequeue.Queue) message.Subscriber, window int, direct bool, n int, work time.Duration) (time.Duration, time.Duration) {
	b.Helper()
	ctx := context.Background()
	q, err := sqlitequeue.Open(ctx, filepath.Join(b.TempDir(), "queue.db"), sqlitequeue.Config{ConsumerGroup: "bench", BatchSize: window})
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

	subCtx := ctx
	if direct {
		subCtx = redelivery.WithDirectSettle(ctx)
	}
	ack := func(m *message.Message) {
		m.Ack()
		redelivery.Settle(m)
	}
	start, cpu0 := time.Now(), processCPU(b)
	in, err := sub.Subscribe(subCtx, "bench")
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
			ack(m)
			continue
		}
		seen[m.UUID] = true
		if work == 0 {
			ack(m)
			acked <- struct{}{}
			continue
		}
		go func() {
			time.Sleep(work)
			ack(m)
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
	return time.Since(start), processCPU(b) - cpu0
}

// processCPU returns the CPU time, user and system, that the process has used so far.
func processCPU(b *testing.B) time.Duration {
	b.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkSubscriber_SteadyLatency publishes one message a millisecond (1,000 msgs/s) for
// 2 s to a subscription that settles directly, with a window of 128, and a consumer that
// acknowledges each message 1 ms after it arrives, and reports the latency from before the
// publish to the hand-out, p50 and p99: the queue's share of the steady state's latency from
// publish to commit. The publish's own commit (synchronous=FULL) is in it.
func BenchmarkSubscriber_SteadyLatency(b *testing.B) {
	const n = 2000
	var p50, p99 time.Duration
	for i := 0; i < b.N; i++ {
		lat := steadyOnce(b, n)
		slices.Sort(lat)
		p50 += lat[n/2]
		p99 += lat[n*99/100]
	}
	b.ReportMetric(float64(p50.Microseconds())/1000/float64(b.N), "p50-ms")
	b.ReportMetric(float64(p99.Microseconds())/1000/float64(b.N), "p99-ms")
	b.ReportMetric(0, "ns/op")
}

// steadyOnce publishes n messages to a fresh queue file at 1,000 msgs/s and returns the
// latency of each from before its publish until a direct-settling subscription handed it out.
func steadyOnce(b *testing.B, n int) []time.Duration {
	b.Helper()
	ctx := context.Background()
	q, err := sqlitequeue.Open(ctx, filepath.Join(b.TempDir(), "queue.db"), sqlitequeue.Config{ConsumerGroup: "bench", BatchSize: 128})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = q.Close() }()
	sub, err := q.Subscriber()
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = sub.Close() }()
	in, err := sub.Subscribe(redelivery.WithDirectSettle(ctx), "steady")
	if err != nil {
		b.Fatal(err)
	}
	published := make(chan error, 1)
	go func() {
		start := time.Now()
		for i := range n {
			time.Sleep(time.Until(start.Add(time.Duration(i) * time.Millisecond)))
			m := message.NewMessage(watermill.NewUUID(), nil)
			m.Metadata.Set("sent", strconv.FormatInt(time.Now().UnixNano(), 10))
			if err := q.Publisher().Publish("steady", m); err != nil {
				published <- err
				return
			}
		}
		published <- nil
	}()
	lat := make([]time.Duration, 0, n)
	for len(lat) < n {
		var m *message.Message
		select {
		case m = <-in:
		case err := <-published:
			if err != nil {
				b.Fatal(err)
			}
			published = nil
			continue
		case <-time.After(30 * time.Second):
			b.Fatalf("%d of %d messages received within 30 s", len(lat), n)
		}
		sent, err := strconv.ParseInt(m.Metadata.Get("sent"), 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(time.Unix(0, sent)))
		time.AfterFunc(time.Millisecond, func() {
			m.Ack()
			redelivery.Settle(m)
		})
	}
	return lat
}
