package sqlitequeue_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// An acknowledgement given right before Close is committed by Close: the message is not
// delivered again, and the backlog is empty as soon as Close returns.
func TestSubscriber_AckRightBeforeCloseIsNotRedelivered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	publishN(t, q, "t", 5)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	var got []*message.Message
	for range 5 {
		got = append(got, testsvc.Receive(t, msgs, 5*time.Second))
	}
	for _, m := range got {
		require.True(t, m.Ack())
	}
	require.NoError(t, sub.Close())

	n, err := q.Backlog(ctx, "t", sqlitequeue.DefaultConsumerGroup)
	require.NoError(t, err)
	require.Zero(t, n, "Close returns once the acknowledgements are committed")
	testsvc.RequireNothing(t, subscribe(t, q, ctx, "t"), 300*time.Millisecond)
}

// A nack comes back no sooner than the delay NackAfter asked for, else than ResendInterval,
// each time with its delivery count up by one.
func TestSubscriber_NackComesBackAfterItsDelayWithCountPlusOne(t *testing.T) {
	t.Parallel()
	const resend = 200 * time.Millisecond
	q := setup(t, sqlitequeue.Config{ResendInterval: resend})
	ids := publishN(t, q, "t", 1)
	msgs := subscribe(t, q, context.Background(), "t")

	m := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, 1, deliveryCount(t, m))
	const asked = 400 * time.Millisecond
	nacked := time.Now()
	require.True(t, redelivery.NackAfter(m, asked))
	m = testsvc.Receive(t, msgs, 5*time.Second)
	require.GreaterOrEqual(t, time.Since(nacked), asked)
	require.Equal(t, ids[0], m.UUID)
	require.Equal(t, 2, deliveryCount(t, m))

	nacked = time.Now()
	m.Nack()
	m = testsvc.Receive(t, msgs, 5*time.Second)
	require.GreaterOrEqual(t, time.Since(nacked), resend)
	require.Equal(t, 3, deliveryCount(t, m))

	nacked = time.Now()
	require.True(t, redelivery.NackAfter(m, 0), "no delay: at once")
	m = testsvc.Receive(t, msgs, 5*time.Second)
	require.Less(t, time.Since(nacked), resend)
	require.Equal(t, 4, deliveryCount(t, m))
	require.True(t, m.Ack())
}

// A message nacked with a delay does not hold back the messages behind it: all of them are
// acknowledged while it waits.
func TestSubscriber_NackedMessageDoesNotBlockTheOnesBehindIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	pub := q.Publisher()
	poison := message.NewMessage("poison", []byte("poison"))
	require.NoError(t, pub.Publish("t", poison))
	good := publishN(t, q, "t", 100)
	msgs := subscribe(t, q, ctx, "t")

	acked := map[string]bool{}
	nacks := 0
	for len(acked) < len(good) {
		m := testsvc.Receive(t, msgs, 5*time.Second)
		if m.UUID == poison.UUID {
			nacks++
			require.True(t, redelivery.NackAfter(m, time.Minute))
			continue
		}
		require.False(t, acked[m.UUID], "%s delivered twice", m.UUID)
		acked[m.UUID] = true
		require.True(t, m.Ack())
	}
	require.Equal(t, 1, nacks, "the poison message waits for its minute")
	eventuallyEqual(t, 1, func() (int64, error) { return q.Backlog(ctx, "t", sqlitequeue.DefaultConsumerGroup) }, "backlog")
	require.Equal(t, []string{poison.UUID}, uuidsOf(mustWaiting(t, q, "t", sqlitequeue.DefaultConsumerGroup)))
}

// Close cancels the contexts of the messages handed out and not settled, and gives every
// unsettled lease back at once: another consumer of the group gets the messages long before
// the ack deadline, those the closed consumer had been handed with their count up by one.
func TestSubscriber_CloseGivesBackUnsettledMessages(t *testing.T) {
	t.Parallel()
	path := testFile(t)
	cfg := sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 4, AckDeadline: time.Minute}
	q := openQueue(t, path, cfg)
	ids := publishN(t, q, "t", 6)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	held := []*message.Message{testsvc.Receive(t, msgs, 5*time.Second), testsvc.Receive(t, msgs, 5*time.Second)}

	start := time.Now()
	require.NoError(t, sub.Close())
	// Long before the ack deadline: at once on a quiet disk, but the close's last transaction
	// waits for the file like any other (it once took 5 s while the database servers of other
	// tests wrote).
	require.Less(t, time.Since(start), cfg.AckDeadline/4)
	for _, m := range held {
		require.ErrorIs(t, m.Context().Err(), context.Canceled)
	}
	_, open := <-msgs
	require.False(t, open)

	other := subscribe(t, openQueue(t, path, cfg), context.Background(), "t")
	got := map[string]int{}
	for range ids {
		m := testsvc.Receive(t, other, 5*time.Second)
		got[m.UUID] = deliveryCount(t, m)
		require.True(t, m.Ack())
	}
	require.Less(t, time.Since(start), 10*time.Second, "given back, not expired")
	require.Equal(t, map[string]int{ids[0]: 2, ids[1]: 2, ids[2]: 1, ids[3]: 1, ids[4]: 1, ids[5]: 1}, got,
		"handed out: counted; claimed but not handed out: not counted")
}

func TestSubscriber_CloseIsIdempotentAndSafeConcurrently(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{})
	publishN(t, q, "t", 3)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := testsvc.Receive(t, msgs, 5*time.Second)
	var wg sync.WaitGroup
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			require.NoError(t, sub.Close())
		}()
	}
	wg.Wait()
	require.NoError(t, sub.Close())
	require.Error(t, m.Context().Err())
	_, err = sub.Subscribe(context.Background(), "t")
	require.ErrorIs(t, err, sqlitequeue.ErrClosed)
}

// Consumers of one group, each with many messages in flight, never hold the same message at
// once; each message is delivered once when every delivery is acknowledged in time.
func TestCompetingConsumers_NeverHoldTheSameMessageAtOnce(t *testing.T) {
	t.Parallel()
	const n = 400
	path := testFile(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	producer := openQueue(t, path, sqlitequeue.Config{})

	var (
		mu         sync.Mutex
		holding    = map[string]int{} // message -> consumer holding it
		deliveries = map[string]int{}
		maxHeld    int
		done       = make(chan struct{})
		work       sync.WaitGroup
	)
	for c := range 3 {
		msgs := subscribe(t, openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 8}), ctx, "jobs")
		go func() {
			for m := range msgs {
				mu.Lock()
				if other, ok := holding[m.UUID]; ok {
					t.Errorf("consumer %d got %s while consumer %d holds it", c, m.UUID, other)
				}
				holding[m.UUID] = c
				deliveries[m.UUID]++
				maxHeld = max(maxHeld, len(holding))
				work.Add(1) // before done: the test's work.Wait must see it
				if len(deliveries) == n {
					close(done)
				}
				mu.Unlock()
				go func() {
					defer work.Done()
					time.Sleep(time.Duration(2+m.UUID[0]%3) * time.Millisecond) // some work
					mu.Lock()
					delete(holding, m.UUID)
					mu.Unlock()
					m.Ack()
				}()
			}
		}()
	}

	publishN(t, producer, "jobs", n)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("not every message was delivered within 30 s")
	}
	work.Wait()
	eventuallyEqual(t, 0, func() (int64, error) { return producer.Backlog(ctx, "jobs", "g") }, "backlog of group g")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, deliveries, n)
	for id, k := range deliveries {
		require.Equal(t, 1, k, "deliveries of %s", id)
	}
	require.Greater(t, maxHeld, 8, "more messages in flight at once than one consumer's window")
	t.Logf("at most %d messages held at once", maxHeld)
}

// While handlers hold their messages, no transaction and no lock of the file is held:
// a connection that waits for no lock at all (busy timeout 0, as another process might have)
// publishes at once, again and again.
func TestPublish_NeverWaitsForHandlers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	q := openQueue(t, path, sqlitequeue.Config{BatchSize: 16})
	publishN(t, q, "t", 16)
	msgs := subscribe(t, q, ctx, "t")
	for range 16 {
		testsvc.Receive(t, msgs, 5*time.Second) // held, unsettled, like running handlers
	}

	impatient, err := sqldb.Open(ctx, "sqlite://"+path+"?_pragma=busy_timeout(0)")
	require.NoError(t, err)
	defer func() { require.NoError(t, impatient.Close()) }()
	for i := range 20 {
		_, err := impatient.ExecContext(ctx, `INSERT INTO "onceflow_queue_t" (uuid, payload, metadata) VALUES (?, ?, '{}')`,
			fmt.Sprintf("raw-%d", i), []byte("x"))
		require.NoError(t, err, "insert %d", i)
	}
	n, err := q.Len(ctx, "t")
	require.NoError(t, err)
	require.EqualValues(t, 36, n)
}

// A message that panics on every delivery, redelivered as fast as the queue allows, neither
// holds back the other messages nor makes publishers of the process wait.
func TestRouter_PanickingMessageStarvesNobody(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{ResendInterval: time.Millisecond})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	var (
		mu     sync.Mutex
		panics int
		done   = map[string]bool{}
	)
	router.AddConsumerHandler("h", "t", sub, func(m *message.Message) error {
		if string(m.Payload) == "panic" {
			mu.Lock()
			panics++
			mu.Unlock()
			panic("cannot process this one")
		}
		mu.Lock()
		done[m.UUID] = true
		mu.Unlock()
		return nil
	})
	testsvc.StartRouter(t, router)

	pub := q.Publisher()
	require.NoError(t, pub.Publish("t", message.NewMessage("poison", []byte("panic"))))
	var slowest time.Duration
	for i := range 50 {
		start := time.Now()
		require.NoError(t, pub.Publish("t", message.NewMessage(fmt.Sprintf("good-%d", i), nil)))
		slowest = max(slowest, time.Since(start))
	}
	eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(done) == 50
	}, "every good message is processed")
	require.Less(t, slowest, 500*time.Millisecond)
	require.NoError(t, router.Close())
	mu.Lock()
	defer mu.Unlock()
	require.Greater(t, panics, 1)
	t.Logf("the poison message panicked %d times; slowest publish %s", panics, slowest)
}

// Close returns within a bounded time even when another connection keeps the file locked, so
// that the subscription cannot commit; what it could not commit is delivered again once its
// lease expires.
func TestClose_BoundedWhenTheFileStaysLocked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	cfg := sqlitequeue.Config{AckDeadline: time.Second}
	q := openQueue(t, path, cfg)
	ids := publishN(t, q, "t", 1)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	m := testsvc.Receive(t, msgs, 5*time.Second)

	unlock := lockFile(t, path)

	require.True(t, m.Ack())
	start := time.Now()
	require.NoError(t, sub.Close())
	took := time.Since(start)
	require.Less(t, took, 8*time.Second)
	unlock()
	t.Logf("Close took %s with the file locked", took)

	// Another process (another Queue over the file) gets the message again. (A later
	// subscription of this Queue would commit the acknowledgement that waits in it.)
	again := testsvc.Receive(t, subscribe(t, openQueue(t, path, cfg), ctx, "t"), 10*time.Second)
	require.Equal(t, ids[0], again.UUID, "the acknowledgement could not be committed: at-least-once")
	require.Equal(t, 2, deliveryCount(t, again))
}

// The messages and offsets tables of topic "orders" as the queue created them before it had
// leases.
const (
	oldMessagesTable = `CREATE TABLE IF NOT EXISTS "onceflow_queue_orders" (
	"offset"   INTEGER PRIMARY KEY AUTOINCREMENT,
	uuid       TEXT NOT NULL,
	payload    BLOB,
	metadata   TEXT,
	created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
)`
	oldOffsetsTable = `CREATE TABLE IF NOT EXISTS "onceflow_offsets_orders" (
	consumer_group TEXT NOT NULL PRIMARY KEY,
	offset_acked   INTEGER NOT NULL DEFAULT 0
)`
)

// lockFile holds the write lock of the queue file at path, from a pool of its own, in a
// transaction that has written to topic "t", until the function it returns rolls it back.
func lockFile(t *testing.T, path string) (unlock func()) {
	t.Helper()
	ctx := context.Background()
	locker, err := sqldb.Open(ctx, "sqlite://"+path)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, locker.Close()) })
	tx, err := locker.BeginTx(ctx, nil) // BEGIN IMMEDIATE: holds the write lock
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO "onceflow_queue_t" (uuid, payload, metadata) VALUES ('locker', NULL, '{}')`)
	require.NoError(t, err)
	return func() { require.NoError(t, tx.Rollback()) }
}

// oldQueueFile returns a queue file with the tables oldMessagesTable and oldOffsetsTable,
// written by the statements stmts.
func oldQueueFile(t *testing.T, stmts ...string) string {
	t.Helper()
	ctx := context.Background()
	path := testFile(t)
	old, err := sqldb.Open(ctx, "sqlite://"+path)
	require.NoError(t, err)
	for _, stmt := range append([]string{oldMessagesTable, oldOffsetsTable}, stmts...) {
		_, err := old.ExecContext(ctx, stmt)
		require.NoError(t, err)
	}
	require.NoError(t, old.Close())
	return path
}

// A queue file written before the queue had leases (messages and offsets tables only, the
// group's acknowledged offset in its offsets row) is consumed from that offset on.
func TestSubscriber_ConsumesAFileOfTheQueueBeforeLeases(t *testing.T) {
	t.Parallel()
	// The tables as the queue created them before it had leases, and what its publisher and
	// subscriber wrote: five messages, of which group "g" acknowledged the first two.
	path := oldQueueFile(t,
		`INSERT INTO "onceflow_queue_orders" (uuid, payload, metadata) VALUES
	('o-1', 'p1', '{}'), ('o-2', 'p2', '{}'), ('o-3', 'p3', '{"k":"v"}'), ('o-4', 'p4', '{}'), ('o-5', 'p5', NULL)`,
		`INSERT INTO "onceflow_offsets_orders" (consumer_group, offset_acked) VALUES ('g', 2)`,
	)

	got := requireOldFileConsumed(t, path, "with no leases table", []delivered{{"o-3", 1}, {"o-4", 1}, {"o-5", 1}}, 5)
	require.Equal(t, "v", got[0].Metadata.Get("k"))
}

// A queue file written before the queue had claims (a lease row per message held, no claims
// table) keeps its leases: a nacked message comes again with its count, then the messages
// after the cursor, and the claims table is created at the first subscription.
func TestSubscriber_ConsumesAFileOfTheQueueBeforeClaims(t *testing.T) {
	t.Parallel()
	path := oldQueueFile(t,
		`CREATE TABLE "onceflow_leases_orders" (
	consumer_group TEXT    NOT NULL,
	"offset"       INTEGER NOT NULL,
	deliveries     INTEGER NOT NULL,
	visible_at     INTEGER NOT NULL,
	PRIMARY KEY (consumer_group, "offset")
) WITHOUT ROWID`,
		`CREATE INDEX "onceflow_due_orders" ON "onceflow_leases_orders" (consumer_group, visible_at)`,
		`INSERT INTO "onceflow_queue_orders" (uuid, payload, metadata) VALUES
	('o-1', 'p1', '{}'), ('o-2', 'p2', '{}'), ('o-3', 'p3', '{}'), ('o-4', 'p4', '{}')`,
		// o-1 acknowledged, o-2 nacked after its first delivery and due.
		`INSERT INTO "onceflow_offsets_orders" (consumer_group, offset_acked) VALUES ('g', 2)`,
		`INSERT INTO "onceflow_leases_orders" (consumer_group, "offset", deliveries, visible_at) VALUES ('g', 2, 1, 0)`,
	)

	requireOldFileConsumed(t, path, "with no claims table", []delivered{{"o-2", 2}, {"o-3", 1}, {"o-4", 1}}, 4)
}

// delivered is a message as a subscription delivers it: its UUID and delivery count.
type delivered struct {
	uuid  string
	count int
}

// requireOldFileConsumed opens the queue file at path for consumer group "g" and requires that
// the messages of topic "orders" waiting for the group are want, in order, before any
// subscription (note says which table the file lacks) and as a subscription delivers and acks
// them; then that nothing more comes, and that Trim deletes trimmed messages. It returns the
// messages delivered.
func requireOldFileConsumed(t *testing.T, path, note string, want []delivered, trimmed int64) []*message.Message {
	t.Helper()
	ctx := context.Background()
	q := openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "g"})
	n, err := q.Backlog(ctx, "orders", "g")
	require.NoError(t, err)
	require.EqualValues(t, len(want), n, "before any subscription, "+note)
	var uuids []string
	for _, w := range want {
		uuids = append(uuids, w.uuid)
	}
	require.Equal(t, uuids, uuidsOf(mustWaiting(t, q, "orders", "g")))

	msgs := subscribe(t, q, ctx, "orders")
	var got []*message.Message
	for _, w := range want {
		m := testsvc.Receive(t, msgs, 5*time.Second)
		require.Equal(t, w.uuid, m.UUID)
		require.Equal(t, w.count, deliveryCount(t, m), w.uuid)
		require.True(t, m.Ack())
		got = append(got, m)
	}
	testsvc.RequireNothing(t, msgs, 200*time.Millisecond)
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "orders", "g") }, "backlog of g")
	n, err = q.Trim(ctx, "orders")
	require.NoError(t, err)
	require.EqualValues(t, trimmed, n)
	return got
}

// Rows that another producer wrote with metadata the queue's publisher would not write are
// delivered, not left to block the group: values that are not strings keep their JSON text,
// metadata that is not an object is dropped (and logged).
func TestSubscriber_ForeignRowsAreDelivered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	require.NoError(t, q.Publisher().Publish("t", message.NewMessage("ours", nil)))
	_, err := q.DB().ExecContext(ctx, `INSERT INTO "onceflow_queue_t" (uuid, payload, metadata) VALUES
	('numbers', 'x', '{"n": 42, "ok": true, "s": "str"}'), ('array', 'y', '[1, 2]'), ('broken', 'z', '{')`)
	require.NoError(t, err)

	msgs := subscribe(t, q, ctx, "t")
	got := map[string]message.Metadata{}
	for range 4 {
		m := testsvc.Receive(t, msgs, 5*time.Second)
		got[m.UUID] = m.Metadata
		require.True(t, m.Ack())
	}
	require.Equal(t, map[string]message.Metadata{
		"ours":    {},
		"numbers": {"n": "42", "ok": "true", "s": "str"},
		"array":   {},
		"broken":  {},
	}, got)
}

// A subscription whose queries fail (here: the file stays locked longer than the queue's busy
// timeout) backs off and goes on by itself once the file is free again: the acknowledgement
// given meanwhile is committed then, and the other messages are delivered.
func TestSubscriber_GoesOnAfterFailedQueries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	q := openQueue(t, "sqlite://"+path+"?_pragma=busy_timeout(50)", sqlitequeue.Config{BatchSize: 1, PollInterval: 10 * time.Millisecond})
	ids := publishN(t, q, "t", 3)
	msgs := subscribe(t, q, ctx, "t")
	first := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], first.UUID)

	unlock := lockFile(t, path)
	require.True(t, first.Ack())
	testsvc.RequireNothing(t, msgs, 500*time.Millisecond) // the settle-and-claim fails meanwhile
	n, err := q.Backlog(ctx, "t", sqlitequeue.DefaultConsumerGroup)
	require.NoError(t, err)
	require.EqualValues(t, 3, n, "the acknowledgement is not committed yet")
	unlock()

	for _, want := range ids[1:] {
		m := testsvc.Receive(t, msgs, 5*time.Second)
		require.Equal(t, want, m.UUID)
		require.Equal(t, 1, deliveryCount(t, m))
		require.True(t, m.Ack())
	}
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "t", sqlitequeue.DefaultConsumerGroup) }, "backlog")
}

// The subscriptions of a topic in one Queue commit their settlements together. One of them
// that ends while the others go on closes its channel only once the acknowledgements given to
// it are committed, also when a transaction of another took them.
func TestSubscriber_OneOfATopicsSubscriptionsEndsWithItsAcksCommitted(t *testing.T) {
	t.Parallel()
	const rounds, window = 30, 4
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: window})
	others, stop := context.WithCancel(ctx)
	defer stop()
	for range 3 {
		msgs := subscribe(t, q, others, "t")
		go func() {
			for m := range msgs {
				m.Ack()
			}
		}()
	}
	published := make(chan struct{})
	go func() {
		defer close(published)
		pub := q.Publisher()
		defer func() { _ = pub.Close() }()
		for others.Err() == nil {
			if err := pub.Publish("t", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
		}
	}()
	defer func() { <-published }()
	defer stop()

	for round := range rounds {
		subCtx, cancel := context.WithCancel(ctx)
		msgs := subscribe(t, q, subCtx, "t")
		// The last one held keeps the subscription from committing the acks by itself at once.
		held := testsvc.ReceiveN(t, msgs, window, 5*time.Second)
		acked := map[string]bool{}
		for _, m := range held[:window-1] {
			require.True(t, m.Ack())
			acked[m.UUID] = true
		}
		cancel()
		for range msgs { // given back
		}
		waiting, err := q.Waiting(ctx, "t", "g", 0, 100000)
		require.NoError(t, err)
		for _, w := range waiting {
			require.False(t, acked[w.Message.UUID], "round %d: message %s acked before its subscription ended is still leased", round, w.Message.UUID)
		}
	}
}
