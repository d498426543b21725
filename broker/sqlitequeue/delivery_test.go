package sqlitequeue_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// A handler that publishes with the delivered message's context publishes like anyone else:
// the message is stored at once, through this Queue or another over the file, and stays
// whatever becomes of the delivery.
func TestPublishInHandler_IsAnOrdinaryPublish(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	q := openQueue(t, path, sqlitequeue.Config{})
	other := openQueue(t, path, sqlitequeue.Config{})
	ids := publishN(t, q, "in", 1)
	msgs := subscribe(t, q, ctx, "in")

	in := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], in.UUID)
	for i, pub := range []message.Publisher{q.Publisher(), other.Publisher()} {
		out := message.NewMessage(fmt.Sprintf("out-%d", i), nil)
		out.SetContext(in.Context())
		start := time.Now()
		require.NoError(t, pub.Publish("out", out))
		require.Less(t, time.Since(start), 2*time.Second)
	}
	n, err := q.Len(ctx, "out")
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "stored before the delivery is settled")

	in.Nack()
	again := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], again.UUID)
	require.True(t, again.Ack())
	<-again.Context().Done()
	late := message.NewMessage("late", nil)
	late.SetContext(again.Context())
	require.NoError(t, q.Publisher().Publish("out", late), "a settled delivery's context is no obstacle either")
	n, err = q.Len(ctx, "out")
	require.NoError(t, err)
	require.EqualValues(t, 3, n, "a nack undoes nothing that was published")
}

const (
	childQueueEnv  = "ONCEFLOW_SQLITEQUEUE_TEST_CHILD_QUEUE"
	childLeaseTime = 500 * time.Millisecond
)

// TestKilledConsumer_Child is the consumer process of TestKilledConsumer_DeliveryCountSurvives.
// It takes the first message of "in", says so on stdout with the message's delivery count,
// and waits to be killed.
func TestKilledConsumer_Child(t *testing.T) {
	path := os.Getenv(childQueueEnv)
	if path == "" {
		t.Skip("run by TestKilledConsumer_DeliveryCountSurvives")
	}
	q, err := sqlitequeue.Open(context.Background(), path, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 1, AckDeadline: childLeaseTime})
	require.NoError(t, err)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), "in")
	require.NoError(t, err)
	m := testsvc.Receive(t, msgs, 20*time.Second)
	testsvc.SayHolding(t, m)
	select {}
}

// startChild starts a consumer process over the queue file at path and returns the id and
// delivery count of the message it holds, and a function that kills it with SIGKILL.
func startChild(t *testing.T, path string) (id string, count int, kill func()) {
	t.Helper()
	child := testsvc.StartChild(t, childQueueEnv+"="+path)
	id, count = child.Holding(t, 30*time.Second)
	return id, count, child.Kill
}

// A message that kills its consumer every time is delivered with a higher count each time: the
// count is in the leases table, not in the dead process, so a router can dead-letter the
// message at its delivery limit and end the crash loop. Each killed consumer's lease expires
// after its ack deadline, and the next consumer claims the message then.
func TestKilledConsumer_DeliveryCountSurvives(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	q := openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "g"})
	poison := publishN(t, q, "in", 1)[0]

	for attempt := 1; attempt <= 3; attempt++ {
		id, count, kill := startChild(t, path)
		require.Equal(t, poison, id)
		require.Equal(t, attempt, count, "delivery count of attempt %d", attempt)
		kill()
	}

	ids := publishN(t, q, "in", 2)
	msgs := subscribe(t, q, ctx, "in")
	got := map[string]int{}
	for range 3 {
		m := testsvc.Receive(t, msgs, 10*time.Second)
		info, ok := redelivery.FromContext(m.Context())
		require.True(t, ok)
		require.True(t, info.DelaysNacks)
		got[m.UUID] = info.Count
		require.True(t, m.Ack())
	}
	require.Equal(t, map[string]int{poison: 4, ids[0]: 1, ids[1]: 1}, got)
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "in", "g") }, "backlog of g")
}
