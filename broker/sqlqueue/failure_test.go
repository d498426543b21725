package sqlqueue_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestClaim_AMessageThatCommitsAfterAHigherOffsetIsNotSkipped(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		q := e.queue(sqlqueue.Config{})
		tp := topic()
		require.NoError(t, q.EnsureTopic(ctx, tp))
		_, ch := e.subscribe(q, tp)

		// The first publishing transaction takes the lower offset and stays open; the second
		// takes the next offset and commits first.
		tx, err := e.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback() }()
		inTx, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: q.SchemaAdapter()}, nil)
		require.NoError(t, err)
		require.NoError(t, inTx.Publish(tp, message.NewMessage("low", []byte("l"))))
		pub, err := q.NewPublisher()
		require.NoError(t, err)
		require.NoError(t, pub.Publish(tp, message.NewMessage("high", []byte("h"))))

		// Neither is handed out while the lower one is uncommitted: the cursor must not pass it.
		testsvc.RequireNothing(t, ch, 500*time.Millisecond)
		require.NoError(t, tx.Commit())
		var order []string
		require.NoError(t, e.db.Select(&order, "SELECT uuid FROM "+e.messagesTable(tp)+" ORDER BY "+e.quote("offset")))
		require.Equal(t, []string{"low", "high"}, order, "the transaction that committed last has the lower offset")

		for _, want := range []string{"low", "high"} {
			m := receive(t, ch)
			require.Equal(t, want, m.UUID)
			ack(m)
		}
		testsvc.RequireNothing(t, ch, 300*time.Millisecond)
	})
}

func TestSubscriber_LostConnectionRedeliversWhatWasInFlightAndGoesOn(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const ackTimeout = 4 * time.Second
		px := e.proxy()
		q := e.queueOn(openDB(t, px.url), sqlqueue.Config{AckTimeout: ackTimeout})
		direct := e.queue(sqlqueue.Config{})
		tp := topic()
		ids := e.publish(direct, tp, "m", 4)
		_, ch := e.subscribe(q, tp)
		var held []*message.Message
		for range ids {
			held = append(held, receive(t, ch))
		}

		px.cut()
		// Acks given while the database is unreachable are written once it is back; the
		// leases of the others pass, and they come again.
		ack(held[0])
		ack(held[1])
		time.Sleep(300 * time.Millisecond) // the outage
		px.restore(t)
		later := e.publish(direct, tp, "later", 1)[0]

		counts := map[string]int{}
		for len(counts) < 3 {
			m := receive(t, ch)
			info, _ := redelivery.FromContext(m.Context())
			counts[m.UUID] = info.Count
			ack(m)
		}
		require.Equal(t, map[string]int{held[2].UUID: 2, held[3].UUID: 2, later: 1}, counts)
		testsvc.RequireNothing(t, ch, time.Second)
	})
}

func TestSubscriber_CloseReturnsInTimeWhenTheDatabaseIsDown(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const closeTimeout = time.Second
		px := e.proxy()
		q := e.queueOn(openDB(t, px.url), sqlqueue.Config{CloseTimeout: closeTimeout})
		tp := topic()
		e.publish(e.queue(sqlqueue.Config{}), tp, "m", 3)
		sub, ch := e.subscribe(q, tp)
		first := receive(t, ch)
		receive(t, ch)
		receive(t, ch)

		px.cut()
		ack(first)
		start := time.Now()
		err := sub.Close()
		require.Less(t, time.Since(start), closeTimeout+time.Second)
		require.ErrorContains(t, err, "acknowledgements: 1, lease changes: 2 not written")
		_, open := <-ch
		require.False(t, open)
	})
}

// childEnv names the environment variables of TestKilledConsumer_Child.
const (
	childURLEnv   = "ONCEFLOW_SQLQUEUE_TEST_CHILD_URL"
	childTopicEnv = "ONCEFLOW_SQLQUEUE_TEST_CHILD_TOPIC"
	// childDirectEnv, when set, makes the child subscribe as a consumer that settles directly.
	childDirectEnv = "ONCEFLOW_SQLQUEUE_TEST_CHILD_DIRECT"
)

// childAckTimeout is the lease of the child consumers' deliveries.
const childAckTimeout = 2 * time.Second

// TestKilledConsumer_Child is the consumer process of TestKilledConsumer_DeliveryCountSurvives.
// It takes one message, says so on stdout with its delivery count, and waits to be killed.
func TestKilledConsumer_Child(t *testing.T) {
	url := os.Getenv(childURLEnv)
	if url == "" {
		t.Skip("run by TestKilledConsumer_DeliveryCountSurvives")
	}
	db := openDB(t, url)
	q, err := sqlqueue.New(db.DB.DB, db.Dialect, sqlqueue.Config{AckTimeout: childAckTimeout, PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	ctx := context.Background()
	if os.Getenv(childDirectEnv) != "" {
		ctx = redelivery.WithDirectSettle(ctx)
	}
	msgs, err := q.Subscriber().Subscribe(ctx, os.Getenv(childTopicEnv))
	require.NoError(t, err)
	m := receive(t, msgs)
	testsvc.SayHolding(t, m)
	select {}
}

// A consumer process killed with SIGKILL while it holds a message leaves it to the others once
// its lease passes, and the delivery count it had survives: a message that kills every
// consumer that takes it is counted up to the router's limit.
func TestKilledConsumer_DeliveryCountSurvives(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{AckTimeout: childAckTimeout})
		tp := topic()
		id := e.publish(q, tp, "m", 1)[0]
		for want := 1; want <= 2; want++ {
			got, count := runChild(t, e.url, tp, e.direct)
			require.Equal(t, id, got)
			require.Equal(t, want, count, "delivery count seen by consumer process %d", want)
		}
		_, ch := e.subscribe(q, tp)
		m := receive(t, ch)
		require.Equal(t, id, m.UUID)
		info, _ := redelivery.FromContext(m.Context())
		require.Equal(t, 3, info.Count)
		ack(m)
		testsvc.RequireNothing(t, ch, childAckTimeout+500*time.Millisecond)
	})
}

// runChild starts TestKilledConsumer_Child on topic, waits until it holds a message, kills it
// with SIGKILL and returns the message's UUID and delivery count. With direct, the child
// subscribes as a consumer that settles directly.
func runChild(t *testing.T, url, topic string, direct bool) (string, int) {
	t.Helper()
	env := []string{childURLEnv + "=" + url, childTopicEnv + "=" + topic}
	if direct {
		env = append(env, childDirectEnv+"=1")
	}
	child := testsvc.StartChild(t, env...)
	defer child.Kill()
	return child.Holding(t, receiveWithin)
}

// Publishers committing concurrently, in whatever order their offsets fall, and three
// competing consumers: every message is handed out exactly once while no lease passes.
func TestClaim_ConcurrentPublishersAndConsumersNeitherSkipNorRepeat(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const publishers, each = 8, 100
		q := e.queue(sqlqueue.Config{Prefetch: 16})
		tp := topic()
		require.NoError(t, q.EnsureTopic(context.Background(), tp))
		got := make(chan string, 2*publishers*each)
		for range 3 {
			_, ch := e.subscribe(q, tp)
			go func() {
				for m := range ch {
					got <- m.UUID
					ack(m)
				}
			}()
		}
		pub, err := q.NewPublisher()
		require.NoError(t, err)
		errs := make(chan error, publishers)
		for p := range publishers {
			go func() {
				for i := range each {
					if err := pub.Publish(tp, message.NewMessage(fmt.Sprintf("p%d-%03d", p, i), nil)); err != nil {
						errs <- err
						return
					}
				}
				errs <- nil
			}()
		}
		for range publishers {
			require.NoError(t, <-errs)
		}
		seen := map[string]int{}
		for len(seen) < publishers*each {
			select {
			case id := <-got:
				seen[id]++
				require.Equal(t, 1, seen[id], "message %s handed out twice", id)
			case <-time.After(receiveWithin):
				t.Fatalf("%d of %d messages received", len(seen), publishers*each)
			}
		}
		select {
		case id := <-got:
			t.Fatalf("message %s handed out again", id)
		case <-time.After(300 * time.Millisecond):
		}
	})
}

func TestSubscriber_AnOutageIsLoggedOnceAndItsEndOnce(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		const retry = 100 * time.Millisecond
		px := e.proxy()
		logs := &levels{}
		q := e.queueOn(openDB(t, px.url), sqlqueue.Config{RetryInterval: retry, Logger: slog.New(logs)})
		direct := e.queue(sqlqueue.Config{})
		tp := topic()
		_, ch := e.subscribe(q, tp)
		e.publish(direct, tp, "before", 1)
		ack(receive(t, ch))

		px.cut()
		time.Sleep(15 * retry) // the outage: a claim fails every RetryInterval
		px.restore(t)
		id := e.publish(direct, tp, "after", 1)[0]
		m := receive(t, ch)
		require.Equal(t, id, m.UUID)
		ack(m)
		testsvc.Eventually(t, 5*time.Second, func() bool { return logs.count("claiming messages again") == 1 }, "the end of the outage is logged")
		require.Equal(t, 1, logs.count("claiming messages failed; trying again until it succeeds"), "the outage is logged once: %v", logs.all())
		require.LessOrEqual(t, logs.count("writing acknowledgements failed; trying again until it succeeds"), 1, "%v", logs.all())
		require.LessOrEqual(t, logs.atError(), 2, "an error line for the claims, and one for the acknowledgements: %v", logs.all())
	})
}

// levels records the messages of the log records at info level and above.
type levels struct {
	mu   sync.Mutex
	msgs []string
	errs int
}

func (l *levels) Enabled(_ context.Context, level slog.Level) bool { return level >= slog.LevelInfo }
func (l *levels) WithAttrs([]slog.Attr) slog.Handler               { return l }
func (l *levels) WithGroup(string) slog.Handler                    { return l }
func (l *levels) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Message)
	if r.Level >= slog.LevelError {
		l.errs++
	}
	return nil
}

func (l *levels) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if m == msg {
			n++
		}
	}
	return n
}

func (l *levels) atError() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.errs
}

func (l *levels) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}
