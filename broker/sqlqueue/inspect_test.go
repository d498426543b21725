package sqlqueue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// waitingIDs returns the UUIDs of what waits for q's group on topic, and whether each is leased.
func waitingIDs(t *testing.T, q *sqlqueue.Queue, topic string) (ids []string, leased []bool) {
	t.Helper()
	ws, err := q.Waiting(context.Background(), topic, 100)
	require.NoError(t, err)
	for _, w := range ws {
		ids = append(ids, w.Message.UUID)
		leased = append(leased, w.Leased)
	}
	return ids, leased
}

func TestWaiting_LeasedFirstThenAfterTheCursor_RemoveTakesExactlyTheChosenOnes(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		q := e.queue(sqlqueue.Config{Prefetch: 2})
		other := e.queue(sqlqueue.Config{ConsumerGroup: "other"})
		tp := topic()
		ids := e.publish(q, tp, "m", 5)
		sub, ch := e.subscribe(q, tp)
		m0, m1 := receive(t, ch), receive(t, ch)
		require.Equal(t, ids[:2], []string{m0.UUID, m1.UUID})

		ws, err := q.Waiting(ctx, tp, 10)
		require.NoError(t, err)
		require.Len(t, ws, 5)
		for i, w := range ws {
			require.Equal(t, ids[i], w.Message.UUID)
			require.Equal(t, i < 2, w.Leased, "message %d", i)
			require.Equal(t, map[bool]int{true: 1, false: 0}[i < 2], w.Deliveries, "message %d", i)
			require.Equal(t, fmt.Sprintf("payload %d \x00\xff", i), string(w.Message.Payload))
		}
		limited, err := q.Waiting(ctx, tp, 3)
		require.NoError(t, err)
		require.Len(t, limited, 3)

		// A leased one and one after the cursor go; the rest stays, for every group.
		require.NoError(t, q.Remove(ctx, tp, ws[1]))
		require.NoError(t, q.Remove(ctx, tp, ws[3]))
		got, leased := waitingIDs(t, q, tp)
		require.Equal(t, []string{ids[0], ids[2], ids[4]}, got)
		require.Equal(t, []bool{true, false, false}, leased)
		got, _ = waitingIDs(t, other, tp)
		require.Equal(t, []string{ids[0], ids[2], ids[4]}, got, "the message is gone for the other group too")

		ack(m1) // its lease is gone: nothing happens
		require.NoError(t, sub.Close())
		_, ch = e.subscribe(q, tp)
		for _, want := range []string{ids[0], ids[2], ids[4]} {
			m := receive(t, ch)
			require.Equal(t, want, m.UUID)
			ack(m)
		}
		testsvc.RequireNothing(t, ch, 300*time.Millisecond)
		// The acknowledgements are written after Ack returns, a batch at a time.
		deadline := time.Now().Add(10 * time.Second)
		for got, _ = waitingIDs(t, q, tp); len(got) > 0 && time.Now().Before(deadline); got, _ = waitingIDs(t, q, tp) {
			time.Sleep(20 * time.Millisecond)
		}
		require.Empty(t, got, "acknowledged, so no longer waiting")
	})
}

func TestWaiting_TopicWithoutTablesHasNone(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		got, _ := waitingIDs(t, e.queue(sqlqueue.Config{}), topic())
		require.Empty(t, got)
	})
}

// A database that watermill-sql's own subscriber consumed from is read as it is: the group's
// acknowledged offset is its cursor, with no leases.
func TestQueue_TakesOverFromWatermillSQLsSubscriber(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		q := e.queue(sqlqueue.Config{})
		tp := topic()
		var offsets wsql.OffsetsAdapter = wsql.DefaultPostgreSQLOffsetsAdapter{}
		if e.dialect == "mysql" {
			offsets = wsql.DefaultMySQLOffsetsAdapter{}
		}
		raw := e.db.DB.DB
		pub, err := wsql.NewPublisher(raw, wsql.PublisherConfig{SchemaAdapter: q.SchemaAdapter(), AutoInitializeSchema: true}, nil)
		require.NoError(t, err)
		var ids []string
		for _, id := range []string{"a", "b", "c", "d"} {
			require.NoError(t, pub.Publish(tp, message.NewMessage(id, []byte(id))))
			ids = append(ids, id)
		}
		old, err := wsql.NewSubscriber(raw, wsql.SubscriberConfig{
			ConsumerGroup:    sqlqueue.DefaultConsumerGroup,
			SchemaAdapter:    q.SchemaAdapter(),
			OffsetsAdapter:   offsets,
			PollInterval:     10 * time.Millisecond,
			InitializeSchema: true,
		}, nil)
		require.NoError(t, err)
		ch, err := old.Subscribe(ctx, tp)
		require.NoError(t, err)
		for _, want := range ids[:2] {
			m := receive(t, ch)
			require.Equal(t, want, m.UUID)
			ack(m)
		}
		receive(t, ch) // held when the old subscriber closes: not acknowledged
		require.NoError(t, old.Close())

		var leaseTables int
		require.NoError(t, e.db.Get(&leaseTables, e.db.Rebind("SELECT COUNT(*) FROM information_schema.tables WHERE table_name = ?"), "onceflow_leases_"+tp))
		require.Zero(t, leaseTables, "watermill-sql made no lease table")
		got, _ := waitingIDs(t, q, tp)
		require.Equal(t, ids[2:], got)

		_, next := e.subscribe(q, tp)
		for _, want := range ids[2:] {
			m := receive(t, next)
			require.Equal(t, want, m.UUID)
			ack(m)
		}
		testsvc.RequireNothing(t, next, 300*time.Millisecond)
	})
}

// Trim deletes exactly the messages every known consumer group has acknowledged: none while no
// group has subscribed, none that a group still leases or has not reached, and the others
// once every group is past them.
func TestTrim_DeletesOnlyWhatEveryGroupAcknowledged(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		q := e.queue(sqlqueue.Config{Prefetch: 2})
		other := e.queue(sqlqueue.Config{ConsumerGroup: "other", Prefetch: 1})
		tp := topic()
		ids := e.publish(q, tp, "m", 5)
		rows := func() int {
			var n int
			require.NoError(t, e.db.Get(&n, `SELECT COUNT(*) FROM `+e.messagesTable(tp)))
			return n
		}
		trimmed := func() int64 {
			n, err := q.Trim(ctx, tp)
			require.NoError(t, err)
			return n
		}
		require.Zero(t, trimmed(), "no group has subscribed")

		_, ch := e.subscribe(q, tp)
		m0, m1 := receive(t, ch), receive(t, ch)
		require.Equal(t, ids[:2], []string{m0.UUID, m1.UUID})
		require.Zero(t, trimmed(), "both are leased")
		ack(m0)
		var total int64
		testsvc.Eventually(t, 10*time.Second, func() bool { total += trimmed(); return total == 1 }, "the acknowledged message was not trimmed")
		require.Equal(t, 4, rows())

		// A second group is known once it subscribes: it has not acknowledged m1 yet.
		_, och := e.subscribe(other, tp)
		o1 := receive(t, och)
		require.Equal(t, ids[1], o1.UUID, "m0 is gone for every group")
		ack(m1)
		require.Zero(t, trimmed(), "the other group leases m1")
		ack(o1)
		total = 0
		testsvc.Eventually(t, 10*time.Second, func() bool { total += trimmed(); return total == 1 }, "m1 was not trimmed once both groups acknowledged it")
		require.Equal(t, 3, rows())
		got, _ := waitingIDs(t, other, tp)
		require.Equal(t, ids[2:], got[len(got)-3:], "the messages after m1 wait for the other group")
	})
}

// Trim deletes in statements of at most 1,000 rows, until nothing acknowledged is left: a topic
// of 2,500 acknowledged messages takes three, and Trim returns them all.
func TestTrim_DeletesAcrossStatements(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		q := e.queue(sqlqueue.Config{Prefetch: 500})
		tp := topic()
		const n = 2500
		pub, err := q.NewPublisher()
		require.NoError(t, err)
		require.NoError(t, q.EnsureTopic(ctx, tp))
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(fmt.Sprintf("m-%04d", i), []byte("x"))
		}
		require.NoError(t, pub.Publish(tp, msgs...))
		_, ch := e.subscribe(q, tp)
		for range n {
			ack(receive(t, ch))
		}
		var total int64
		testsvc.Eventually(t, 20*time.Second, func() bool {
			got, err := q.Trim(ctx, tp)
			require.NoError(t, err)
			total += got
			// MySQL and MariaDB keep the message at the highest offset (Trim's doc).
			return total == n || e.db.Dialect == sqldb.MySQL && total == n-1
		}, "%d of %d acknowledged messages trimmed", total, n)
		var rows int
		require.NoError(t, e.db.Get(&rows, `SELECT COUNT(*) FROM `+e.messagesTable(tp)))
		require.Equal(t, n-int(total), rows)
	})
}
