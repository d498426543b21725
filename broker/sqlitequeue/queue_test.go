package sqlitequeue_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

func TestConfig_ValidateNamesTheField(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]sqlitequeue.Config{
		"BatchSize":      {BatchSize: -1},
		"PollInterval":   {PollInterval: -time.Millisecond},
		"ResendInterval": {ResendInterval: -time.Millisecond},
		"RetryInterval":  {RetryInterval: -time.Millisecond},
		"AckDeadline":    {AckDeadline: -time.Second},
	} {
		err := cfg.Validate()
		require.ErrorContains(t, err, "Config."+field, field)
		_, err = sqlitequeue.Open(context.Background(), testFile(t), cfg)
		require.ErrorContains(t, err, "Config."+field, field)
	}
	require.ErrorContains(t, sqlitequeue.Config{BatchSize: 10001}.Validate(), "Config.BatchSize")
	require.ErrorContains(t, sqlitequeue.Config{AckDeadline: time.Microsecond}.Validate(), "Config.AckDeadline: 1µs is shorter than 1ms")
	require.ErrorContains(t, sqlitequeue.Config{ResendInterval: time.Microsecond}.Validate(), "Config.ResendInterval: 1µs is shorter than 1ms")
	require.ErrorContains(t, sqlitequeue.Config{ConsumerGroup: strings.Repeat("g", 256)}.Validate(), "Config.ConsumerGroup")
	require.NoError(t, sqlitequeue.Config{}.Validate())
	require.NoError(t, sqlitequeue.Config{BatchSize: 1, AckDeadline: time.Millisecond, ResendInterval: time.Millisecond}.Validate())
}

func TestOpen_DefaultsFilledIn(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{})
	cfg := q.Config()
	require.Equal(t, sqlitequeue.DefaultConsumerGroup, cfg.ConsumerGroup)
	require.Equal(t, sqlitequeue.DefaultBatchSize, cfg.BatchSize)
	require.Equal(t, sqlitequeue.DefaultPollInterval, cfg.PollInterval)
	require.Equal(t, sqlitequeue.DefaultResendInterval, cfg.ResendInterval)
	require.Equal(t, sqlitequeue.DefaultRetryInterval, cfg.RetryInterval)
	require.Equal(t, sqlitequeue.DefaultAckDeadline, cfg.AckDeadline)
	require.NotNil(t, cfg.Logger)
}

func TestOpen_AcceptsURLAndBarePathAndCreatesTheFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ctx := context.Background()
	for _, url := range []string{
		filepath.Join(dir, "bare.db"),
		"sqlite://" + filepath.Join(dir, "url.db"),
		"sqlite://" + filepath.Join(dir, "params.db") + "?_pragma=cache_size(-4000)",
	} {
		q, err := sqlitequeue.Open(ctx, url, sqlitequeue.Config{})
		require.NoError(t, err, url)
		publishN(t, q, "t", 1)
		n, err := q.Len(ctx, "t")
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		require.NoError(t, q.Close())
	}
	for _, name := range []string{"bare.db", "url.db", "params.db"} {
		_, err := os.Stat(filepath.Join(dir, name))
		require.NoError(t, err, name)
	}
}

func TestOpen_RejectsOtherSchemesAndMissingDirectories(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := sqlitequeue.Open(ctx, "postgres://u:secret@localhost/db", sqlitequeue.Config{})
	require.ErrorContains(t, err, `scheme "postgres" is not sqlite`)
	require.NotContains(t, err.Error(), "secret")

	missing := filepath.Join(t.TempDir(), "no", "such", "dir", "q.db")
	_, err = sqlitequeue.Open(ctx, missing, sqlitequeue.Config{})
	require.ErrorContains(t, err, "does not exist")

	for _, url := range []string{"", "sqlite://", "sqlite://:memory:", ":memory:", "sqlite://x.db?mode=memory"} {
		_, err = sqlitequeue.Open(ctx, url, sqlitequeue.Config{})
		require.Error(t, err, url)
	}
}

func TestNew_RejectsOtherDialects(t *testing.T) {
	t.Parallel()
	_, err := sqlitequeue.New(&sqldb.DB{Dialect: sqldb.Postgres}, sqlitequeue.Config{})
	require.ErrorContains(t, err, "want sqlite")
	_, err = sqlitequeue.New(nil, sqlitequeue.Config{})
	require.Error(t, err)
}

func TestNew_UsesTheGivenDatabaseAndLeavesItOpen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sqldb.Open(ctx, "sqlite://"+testFile(t))
	require.NoError(t, err)
	defer func() { require.NoError(t, db.Close()) }()

	q, err := sqlitequeue.New(db, sqlitequeue.Config{})
	require.NoError(t, err)
	require.Same(t, db, q.DB())
	publishN(t, q, "t", 2)
	require.NoError(t, q.Close())
	require.NoError(t, db.PingContext(ctx), "Close of a Queue made by New must not close the database")
	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM "onceflow_queue_t"`).Scan(&n))
	require.Equal(t, 2, n)
}

func TestTopics_NamesAreValidatedAndQuoted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	pub := q.Publisher()

	topics := []string{"orders.v1", "orders-v1", "a$b:c_d", "Orders", "orders", "offsets_orders"}
	for i, topic := range topics {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))), topic)
	}
	for i, topic := range topics {
		records, err := q.List(ctx, topic, 0, 10)
		require.NoError(t, err, topic)
		require.Len(t, records, 1, "topic %q must have its own table", topic)
		require.Equal(t, strconv.Itoa(i), string(records[0].Message.Payload), topic)
	}
	got, err := q.Topics(ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, topics, got)

	for _, bad := range []string{"", `a"b`, "a b", "x; DROP TABLE y", "a/b", "é", string(make([]byte, 201))} {
		err := pub.Publish(bad, message.NewMessage(watermill.NewUUID(), nil))
		require.ErrorIs(t, err, sqlitequeue.ErrInvalidTopic, "%q", bad)
		sub, err := q.Subscriber()
		require.NoError(t, err)
		_, err = sub.Subscribe(ctx, bad)
		require.ErrorIs(t, err, sqlitequeue.ErrInvalidTopic, "%q", bad)
		require.NoError(t, sub.Close())
	}
}

func TestPublish_LargeCallKeepsOrderAndPayloads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	ids := publishN(t, q, "big", 2500) // more than one INSERT statement

	msgs := subscribe(t, q, ctx, "big")
	for i, id := range ids {
		msg := testsvc.Receive(t, msgs, 10*time.Second)
		require.Equal(t, id, msg.UUID, "message %d", i)
		require.Equal(t, strconv.Itoa(i), string(msg.Payload))
		require.True(t, msg.Ack())
	}
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "big", sqlitequeue.DefaultConsumerGroup) }, "backlog")
}

func TestPublish_MetadataAndEmptyPayloadRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	in := message.NewMessage("id-1", nil)
	in.Metadata.Set("k", "v")
	in.Metadata.Set("quote", `"x"`)
	require.NoError(t, q.Publisher().Publish("t", in))

	msg := testsvc.Receive(t, subscribe(t, q, ctx, "t"), 5*time.Second)
	require.Equal(t, "id-1", msg.UUID)
	require.Empty(t, msg.Payload)
	require.Equal(t, message.Metadata{"k": "v", "quote": `"x"`}, msg.Metadata)
	msg.Ack()
}

func TestClose_PublishersAndSubscribersFailAfterwards(t *testing.T) {
	t.Parallel()
	q, err := sqlitequeue.Open(context.Background(), testFile(t), sqlitequeue.Config{})
	require.NoError(t, err)
	pub := q.Publisher()
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)

	require.NoError(t, q.Close())
	require.NoError(t, q.Close(), "Close is idempotent")
	_, open := <-msgs
	require.False(t, open, "Close of the Queue ends its subscriptions")
	require.ErrorIs(t, pub.Publish("t", message.NewMessage("x", nil)), sqlitequeue.ErrClosed)
	_, err = q.Subscriber()
	require.ErrorIs(t, err, sqlitequeue.ErrClosed)
	_, err = q.Len(context.Background(), "t")
	require.ErrorIs(t, err, sqlitequeue.ErrClosed)

	pub2 := setup(t, sqlitequeue.Config{}).Publisher()
	require.NoError(t, pub2.Close())
	require.ErrorIs(t, pub2.Publish("t", message.NewMessage("x", nil)), sqlitequeue.ErrClosed)
}

// Two consumers of one group over two Queues (two connection pools, as two processes would
// have): when every delivery is acknowledged, every message is delivered exactly once.
func TestCompetingConsumers_EachMessageToExactlyOneConsumer(t *testing.T) {
	t.Parallel()
	const n = 300
	path := testFile(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	producer := openQueue(t, path, sqlitequeue.Config{})
	consumers := []*sqlitequeue.Queue{
		openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 4}),
		openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 4}),
	}

	var mu sync.Mutex
	deliveries := map[string]int{}
	perConsumer := make([]int, len(consumers))
	var wg sync.WaitGroup
	for i, q := range consumers {
		msgs := subscribe(t, q, ctx, "jobs")
		wg.Add(1)
		go func() {
			defer wg.Done()
			for msg := range msgs {
				mu.Lock()
				deliveries[msg.UUID]++
				perConsumer[i]++
				mu.Unlock()
				time.Sleep(100 * time.Microsecond) // some work while the other consumer competes
				msg.Ack()
			}
		}()
	}

	ids := publishN(t, producer, "jobs", n)
	eventuallyEqual(t, 0, func() (int64, error) { return producer.Backlog(ctx, "jobs", "g") }, "backlog of group g")
	time.Sleep(200 * time.Millisecond) // room for any redelivery to show up
	cancel()
	wg.Wait()

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, deliveries, n)
	for _, id := range ids {
		require.Equal(t, 1, deliveries[id], "deliveries of %s", id)
	}
	require.Equal(t, n, perConsumer[0]+perConsumer[1])
	t.Logf("deliveries per consumer: %v", perConsumer)
}

func TestConsumerGroups_EachGroupGetsEveryMessageOnce(t *testing.T) {
	t.Parallel()
	const n = 100
	path := testFile(t)
	ctx := context.Background()
	producer := openQueue(t, path, sqlitequeue.Config{})
	groups := []string{"billing", "shipping", "audit"}
	subs := map[string]<-chan *message.Message{}
	for _, g := range groups {
		subs[g] = subscribe(t, openQueue(t, path, sqlitequeue.Config{ConsumerGroup: g}), ctx, "orders")
	}
	ids := publishN(t, producer, "orders", n)

	var wg sync.WaitGroup
	got := make(map[string][]string, len(groups))
	var mu sync.Mutex
	for _, g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var seen []string
			for range n {
				select {
				case msg := <-subs[g]:
					seen = append(seen, msg.UUID)
					msg.Ack()
				case <-time.After(10 * time.Second):
					t.Errorf("group %s: timed out after %d messages", g, len(seen))
					return
				}
			}
			mu.Lock()
			got[g] = seen
			mu.Unlock()
		}()
	}
	wg.Wait()
	for _, g := range groups {
		require.Equal(t, ids, got[g], "group %s receives every message once, in order", g)
		testsvc.RequireNothing(t, subs[g], 100*time.Millisecond)
		eventuallyEqual(t, 0, func() (int64, error) { return producer.Backlog(ctx, "orders", g) }, "backlog of "+g)
	}
}

// A subscription whose context ends gives back the messages it holds unsettled, after
// committing the acknowledgements given before: the next consumer of the group gets the rest,
// and a message the consumer had been handed comes with its delivery count up by one.
func TestSubscriber_UnackedMessageGoesToTheNextConsumer(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{})
	ids := publishN(t, q, "t", 3)

	ctx, cancel := context.WithCancel(context.Background())
	msgs := subscribe(t, q, ctx, "t")
	m := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], m.UUID)
	require.True(t, m.Ack())
	m = testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[1], m.UUID)
	cancel() // dies holding ids[1], without acking it; ids[2] was claimed, not handed out

	next := subscribe(t, q, context.Background(), "t")
	got := map[string]int{}
	for range 2 {
		m := testsvc.Receive(t, next, 5*time.Second)
		got[m.UUID] = deliveryCount(t, m)
		require.True(t, m.Ack())
	}
	require.Equal(t, map[string]int{ids[1]: 2, ids[2]: 1}, got, "the acknowledged ids[0] is not delivered again")
	testsvc.RequireNothing(t, next, 200*time.Millisecond)
}

func TestSubscriber_AckDeadlineRedelivers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{AckDeadline: 200 * time.Millisecond})
	ids := publishN(t, q, "t", 1)
	msgs := subscribe(t, q, ctx, "t")

	first := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], first.UUID)
	require.Equal(t, 1, deliveryCount(t, first))
	select {
	case <-first.Context().Done():
		require.ErrorIs(t, context.Cause(first.Context()), context.DeadlineExceeded)
	case <-time.After(5 * time.Second):
		t.Fatal("the message's context must end at the ack deadline")
	}
	again := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], again.UUID)
	require.Equal(t, 2, deliveryCount(t, again))
	require.True(t, again.Ack())
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "t", sqlitequeue.DefaultConsumerGroup) }, "backlog")
}

func TestInspect_LenBacklogListTrim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	q := openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "a"})
	b := openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "b"})

	n, err := q.Len(ctx, "never-used")
	require.NoError(t, err)
	require.Zero(t, n)
	records, err := q.List(ctx, "never-used", 0, 10)
	require.NoError(t, err)
	require.Empty(t, records)
	_, err = q.List(ctx, "t", 0, 0)
	require.Error(t, err)

	before := time.Now().UTC().Add(-time.Second)
	ids := publishN(t, q, "t", 5)
	n, err = q.Len(ctx, "t")
	require.NoError(t, err)
	require.EqualValues(t, 5, n)
	n, err = q.Backlog(ctx, "t", "nobody")
	require.NoError(t, err)
	require.EqualValues(t, 5, n, "a group that never consumed has everything to do")

	page1, err := q.List(ctx, "t", 0, 3)
	require.NoError(t, err)
	require.Len(t, page1, 3)
	page2, err := q.List(ctx, "t", page1[2].Offset, 3)
	require.NoError(t, err)
	require.Len(t, page2, 2)
	for i, r := range append(page1, page2...) {
		require.Equal(t, ids[i], r.Message.UUID)
		require.Equal(t, strconv.Itoa(i), string(r.Message.Payload))
		require.True(t, r.CreatedAt.After(before) && r.CreatedAt.Before(time.Now().Add(time.Second)), "created at %s", r.CreatedAt)
		if i > 0 {
			require.Greater(t, r.Offset, page1[0].Offset)
		}
	}

	// Group a consumes 3 and closes (a graceful Close commits what was acknowledged and gives
	// back the rest, still waiting), group b subscribes and consumes nothing.
	consumeAndClose(t, q, "t", 3)
	n, err = q.Backlog(ctx, "t", "a")
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	consumeAndClose(t, b, "t", 0)
	n, err = q.Backlog(ctx, "t", "b")
	require.NoError(t, err)
	require.EqualValues(t, 5, n)

	trimmed, err := q.Trim(ctx, "t")
	require.NoError(t, err)
	require.Zero(t, trimmed, "group b has acknowledged nothing")

	consumeAndClose(t, b, "t", 4)
	n, err = q.Backlog(ctx, "t", "b")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	trimmed, err = q.Trim(ctx, "t")
	require.NoError(t, err)
	require.EqualValues(t, 3, trimmed, "messages acknowledged by both groups")
	records, err = q.List(ctx, "t", 0, 10)
	require.NoError(t, err)
	require.Len(t, records, 2)
	require.Equal(t, ids[3], records[0].Message.UUID)

	_, err = q.Trim(ctx, "bad topic")
	require.ErrorIs(t, err, sqlitequeue.ErrInvalidTopic)
}

func TestTableNames(t *testing.T) {
	t.Parallel()
	require.Equal(t, "onceflow_queue_orders.v1", sqlitequeue.MessagesTable("orders.v1"))
	require.Equal(t, "onceflow_offsets_orders.v1", sqlitequeue.OffsetsTable("orders.v1"))
	require.Equal(t, "onceflow_queue_^orders-^x", sqlitequeue.MessagesTable("Orders-X"))
	require.True(t, errors.Is(sqlitequeue.CheckTopic("a b"), sqlitequeue.ErrInvalidTopic))
}

// consumeAndClose subscribes to topic with a new subscriber of q, acknowledges n messages and
// closes the subscriber, which commits the acknowledgements and gives back what it claimed
// beyond them.
func consumeAndClose(t *testing.T, q *sqlitequeue.Queue, topic string, n int) {
	t.Helper()
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	for range n {
		require.True(t, testsvc.Receive(t, msgs, 5*time.Second).Ack())
	}
	require.NoError(t, sub.Close())
}

// A consumer working through a backlog takes the write lock only for its short claims and
// settlements; a publisher of the same process (here through another Queue over the file) gets
// its turn promptly, instead of waiting for the backlog to drain.
func TestPublish_NotStarvedByAConsumerWithABacklog(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	path := testFile(t)
	q := openQueue(t, path, sqlitequeue.Config{})
	publishN(t, q, "backlog", 3000)
	msgs := subscribe(t, q, ctx, "backlog")
	go func() {
		for m := range msgs {
			time.Sleep(500 * time.Microsecond)
			m.Ack()
		}
	}()
	eventually(t, func() bool {
		n, err := q.Backlog(ctx, "backlog", sqlitequeue.DefaultConsumerGroup)
		require.NoError(t, err)
		return n < 3000
	}, "the consumer commits its first batch")

	pub := openQueue(t, path, sqlitequeue.Config{}).Publisher()
	var slowest time.Duration
	for range 10 {
		start := time.Now()
		require.NoError(t, pub.Publish("other", message.NewMessage(watermill.NewUUID(), nil)))
		slowest = max(slowest, time.Since(start))
		time.Sleep(10 * time.Millisecond)
	}
	require.Less(t, slowest, 500*time.Millisecond)
	left, err := q.Backlog(ctx, "backlog", sqlitequeue.DefaultConsumerGroup)
	require.NoError(t, err)
	require.Greater(t, left, int64(0), "the backlog must still be there for the test to mean anything")
	t.Logf("slowest publish %s, backlog left %d", slowest, left)
}

func TestInspect_WaitingAndDelete(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "a"})

	waiting, err := q.Waiting(ctx, "never-used", "a", 0, 10)
	require.NoError(t, err)
	require.Empty(t, waiting)
	found, err := q.Delete(ctx, "never-used", 1)
	require.NoError(t, err)
	require.False(t, found)

	ids := publishN(t, q, "t", 4)
	records, err := q.List(ctx, "t", 0, 10)
	require.NoError(t, err)
	require.Len(t, records, 4)
	require.Equal(t, ids, uuidsOf(mustWaiting(t, q, "t", "a")), "a group that never consumed has everything to do")

	consumeAndClose(t, q, "t", 1)
	require.Equal(t, ids[1:], uuidsOf(mustWaiting(t, q, "t", "a")), "given back, the claimed messages still wait")

	// Deleting the third message: the group's next messages are the second, then the fourth.
	found, err = q.Delete(ctx, "t", records[2].Offset)
	require.NoError(t, err)
	require.True(t, found)
	found, err = q.Delete(ctx, "t", records[2].Offset)
	require.NoError(t, err)
	require.False(t, found, "already deleted")
	require.Equal(t, []string{ids[1], ids[3]}, uuidsOf(mustWaiting(t, q, "t", "a")))
	page, err := q.Waiting(ctx, "t", "a", records[1].Offset, 10)
	require.NoError(t, err)
	require.Equal(t, []string{ids[3]}, uuidsOf(page))
	n, err := q.Backlog(ctx, "t", "a")
	require.NoError(t, err)
	require.EqualValues(t, 2, n)

	msgs := subscribe(t, q, ctx, "t")
	for _, want := range []string{ids[1], ids[3]} {
		m := testsvc.Receive(t, msgs, 10*time.Second)
		require.Equal(t, want, m.UUID)
		m.Ack()
	}
	testsvc.RequireNothing(t, msgs, 100*time.Millisecond)
}

// Delete removes a message that a consumer holds: its lease goes with it, so the message is
// never delivered again, and the consumer's nack of it does nothing.
func TestInspect_DeleteOfAHeldMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "a", ResendInterval: time.Millisecond})
	ids := publishN(t, q, "t", 2)
	msgs := subscribe(t, q, ctx, "t")
	held := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], held.UUID)
	records := mustWaiting(t, q, "t", "a")
	require.Equal(t, ids, uuidsOf(records), "a held message waits until it is acknowledged")

	found, err := q.Delete(ctx, "t", records[0].Offset)
	require.NoError(t, err)
	require.True(t, found)
	held.Nack()
	second := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[1], second.UUID)
	require.True(t, second.Ack())
	testsvc.RequireNothing(t, msgs, 200*time.Millisecond)
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "t", "a") }, "backlog")
}

func mustWaiting(t *testing.T, q *sqlitequeue.Queue, topic, group string) []sqlitequeue.Record {
	t.Helper()
	records, err := q.Waiting(context.Background(), topic, group, 0, 100)
	require.NoError(t, err)
	return records
}

func uuidsOf(records []sqlitequeue.Record) []string {
	out := make([]string, len(records))
	for i, r := range records {
		out[i] = r.Message.UUID
	}
	return out
}

// Messages that reach a topic's tables without the queue's Publisher (a transaction of the
// application, as the outbox writes) are claimed by an idle subscription as soon as Wake is
// called, not at its next poll.
func TestQueue_WakeMakesAnIdleSubscriptionLookAtOnce(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{PollInterval: time.Hour})
	ctx := context.Background()
	require.NoError(t, q.CreateTables(ctx, "orders"))
	require.NoError(t, q.CreateTables(ctx, "orders"), "CreateTables is harmless to repeat")
	var groups int
	require.NoError(t, q.DB().Get(&groups, `SELECT COUNT(*) FROM onceflow_offsets_orders`))
	require.Zero(t, groups, "CreateTables records no consumer group")

	msgs := subscribe(t, q, ctx, "orders")
	testsvc.RequireNothing(t, msgs, 100*time.Millisecond) // the first look found nothing
	_, err := q.DB().Exec(`INSERT INTO onceflow_queue_orders (uuid, payload, metadata) VALUES ('m-1', 'x', '{}')`)
	require.NoError(t, err)
	testsvc.RequireNothing(t, msgs, 100*time.Millisecond)
	q.Wake("orders")
	m := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, "m-1", m.UUID)
	m.Ack()
}
