package sqlitequeue_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// publishFromHandler publishes a message to topic with the context of the delivered message in,
// as a handler (or the router's dead-letter path) does, and fails the test if that takes long:
// a publish that waited for the write lock its own subscription holds would take the 30 s busy
// timeout.
func publishFromHandler(t *testing.T, pub message.Publisher, in *message.Message, topic, payload string) {
	t.Helper()
	out := message.NewMessage("out-of-"+in.UUID, []byte(payload))
	out.SetContext(in.Context())
	start := time.Now()
	require.NoError(t, pub.Publish(topic, out))
	require.Less(t, time.Since(start), 2*time.Second, "publish from inside the handler must not wait for the lock")
}

func TestPublishInHandler_SameQueue_CommitsWithTheAck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	q := openQueue(t, path, sqlitequeue.Config{})
	other := openQueue(t, path, sqlitequeue.Config{}) // another Queue over the same file
	ids := publishN(t, q, "in", 2)
	msgs := subscribe(t, q, ctx, "in")

	first := receive(t, msgs, 5*time.Second)
	publishFromHandler(t, q.Publisher(), first, "out", "from the queue's own publisher")
	publishFromHandler(t, other.Publisher(), first, "in", "back onto the consumed topic, through another Queue")
	n, err := q.Len(ctx, "out")
	require.NoError(t, err)
	require.Zero(t, n, "not visible before the delivery's transaction commits")
	require.True(t, first.Ack())
	<-first.Context().Done()
	late := message.NewMessage("late", nil)
	late.SetContext(first.Context())
	require.ErrorIs(t, q.Publisher().Publish("out", late), sqlitequeue.ErrDeliveryEnded, "a handler publishes before it acknowledges")

	second := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[1], second.UUID)
	second.Ack()
	third := receive(t, msgs, 5*time.Second)
	require.Equal(t, "out-of-"+ids[0], third.UUID, "the message published back to \"in\" is consumed after the others")
	third.Ack()

	eventuallyEqual(t, 1, func() (int64, error) { return q.Len(ctx, "out") }, "messages on out")
	records, err := q.List(ctx, "out", 0, 10)
	require.NoError(t, err)
	require.Equal(t, "out-of-"+ids[0], records[0].Message.UUID)
	require.Equal(t, "from the queue's own publisher", string(records[0].Message.Payload))
}

func TestPublishInHandler_NackUndoesWhatTheAttemptPublished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	ids := publishN(t, q, "in", 2)
	msgs := subscribe(t, q, ctx, "in")
	pub := q.Publisher()

	first := receive(t, msgs, 5*time.Second)
	require.True(t, first.Ack()) // an acked delivery before it in the same batch stays
	second := receive(t, msgs, 5*time.Second)
	publishFromHandler(t, pub, second, "out", "attempt 1")
	second.Nack()
	retry := receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[1], retry.UUID)
	publishFromHandler(t, pub, retry, "out", "attempt 2")
	retry.Ack()

	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "in", sqlitequeue.DefaultConsumerGroup) }, "backlog")
	records, err := q.List(ctx, "out", 0, 10)
	require.NoError(t, err)
	require.Len(t, records, 1)
	require.Equal(t, "attempt 2", string(records[0].Message.Payload))
}

func TestPublishInHandler_AckDeadlineUndoesWhatTheAttemptPublished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{AckDeadline: 300 * time.Millisecond})
	publishN(t, q, "in", 1)
	msgs := subscribe(t, q, ctx, "in")
	pub := q.Publisher()

	slow := receive(t, msgs, 5*time.Second)
	publishFromHandler(t, pub, slow, "out", "too late")
	<-slow.Context().Done()
	late := message.NewMessage("late", nil)
	late.SetContext(slow.Context())
	require.Error(t, pub.Publish("out", late), "a publish in an expired delivery fails")

	again := receive(t, msgs, 5*time.Second)
	require.Equal(t, slow.UUID, again.UUID)
	again.Ack()
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "in", sqlitequeue.DefaultConsumerGroup) }, "backlog")
	n, err := q.Len(ctx, "out")
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestPublishInHandler_ConsumerDiesBeforeCommit(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{})
	ids := publishN(t, q, "in", 1)

	ctx, die := context.WithCancel(context.Background())
	msgs := subscribe(t, q, ctx, "in")
	m := receive(t, msgs, 5*time.Second)
	publishFromHandler(t, q.Publisher(), m, "out", "lost with the consumer")
	die()

	next := subscribe(t, q, context.Background(), "in")
	again := receive(t, next, 5*time.Second)
	require.Equal(t, ids[0], again.UUID)
	again.Ack()
	n, err := q.Len(context.Background(), "out")
	require.NoError(t, err)
	require.Zero(t, n)
}

// A publish whose context is not a delivery of the queue file is independent of any
// consumer: it commits at once.
func TestPublish_WithForeignContextCommitsAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := setup(t, sqlitequeue.Config{})
	m := message.NewMessage("m", nil)
	m.SetContext(context.WithValue(ctx, struct{ k string }{"k"}, "v"))
	require.NoError(t, q.Publisher().Publish("t", m))
	n, err := q.Len(ctx, "t")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
}

const childQueueEnv = "ONCEFLOW_SQLITEQUEUE_TEST_CHILD_QUEUE"

// TestKilledConsumer_Child is the consumer process of TestKilledConsumer_RedeliversToNextConsumer.
// It takes the first message of "in", publishes to "out" in the delivery's transaction, says
// so on stdout and waits to be killed.
func TestKilledConsumer_Child(t *testing.T) {
	path := os.Getenv(childQueueEnv)
	if path == "" {
		t.Skip("run by TestKilledConsumer_RedeliversToNextConsumer")
	}
	q, err := sqlitequeue.Open(context.Background(), path, sqlitequeue.Config{ConsumerGroup: "g"})
	require.NoError(t, err)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), "in")
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	out := message.NewMessage("out-of-"+m.UUID, nil)
	out.SetContext(m.Context())
	require.NoError(t, q.Publisher().Publish("out", out))
	fmt.Printf("HOLDING %s\n", m.UUID)
	select {}
}

// A consumer process killed with SIGKILL in the middle of a batch loses nothing: its
// transaction rolls back, what it published in the delivery's transaction vanishes, and the
// batch goes to the next consumer of the group, which could not have it while the first held it.
func TestKilledConsumer_RedeliversToNextConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testFile(t)
	q := openQueue(t, path, sqlitequeue.Config{ConsumerGroup: "g"})
	ids := publishN(t, q, "in", 3)

	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledConsumer_Child$", "-test.timeout=60s")
	cmd.Env = append(os.Environ(), childQueueEnv+"="+path)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	holding := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if id, ok := strings.CutPrefix(sc.Text(), "HOLDING "); ok {
				holding <- id
			}
		}
	}()
	select {
	case id := <-holding:
		require.Equal(t, ids[0], id)
	case <-time.After(30 * time.Second):
		t.Fatal("the child consumer did not take a message")
	}

	// While the child holds the batch, a competing consumer of the group gets nothing.
	msgs := subscribe(t, q, ctx, "in")
	requireNothing(t, msgs, 300*time.Millisecond)

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	killed = true

	for i, id := range ids {
		m := receive(t, msgs, 10*time.Second)
		require.Equal(t, id, m.UUID, "message %d", i)
		m.Ack()
	}
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "in", "g") }, "backlog of g")
	n, err := q.Len(ctx, "out")
	require.NoError(t, err)
	require.Zero(t, n, "the killed consumer's publish rolled back with its transaction")
}
