package sqlitequeue_test

import (
	"context"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// testFile returns the path of a queue file in a fresh directory.
func testFile(t *testing.T) string {
	t.Helper()
	return filepath.Join(t.TempDir(), "queue.db")
}

// openQueue opens a Queue over path, closed when the test ends.
func openQueue(t *testing.T, path string, cfg sqlitequeue.Config) *sqlitequeue.Queue {
	t.Helper()
	q, err := sqlitequeue.Open(context.Background(), path, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, q.Close()) })
	return q
}

// setup opens a Queue over a fresh file with cfg.
func setup(t *testing.T, cfg sqlitequeue.Config) *sqlitequeue.Queue {
	t.Helper()
	return openQueue(t, testFile(t), cfg)
}

// subscribe starts a subscription of a new subscriber of q, closed when the test ends.
func subscribe(t *testing.T, q *sqlitequeue.Queue, ctx context.Context, topic string) <-chan *message.Message {
	t.Helper()
	sub, err := q.Subscriber()
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	return msgs
}

// publishN publishes n messages with payloads "0".."n-1" to topic and returns their ids.
func publishN(t *testing.T, q *sqlitequeue.Queue, topic string, n int) []string {
	t.Helper()
	pub := q.Publisher()
	defer func() { require.NoError(t, pub.Close()) }()
	msgs := make([]*message.Message, n)
	ids := make([]string, n)
	for i := range msgs {
		ids[i] = watermill.NewUUID()
		msgs[i] = message.NewMessage(ids[i], []byte(strconv.Itoa(i)))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	return ids
}

// eventuallyEqual waits up to 10 s for get to return want.
func eventuallyEqual(t *testing.T, want int64, get func() (int64, error), what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := get()
		require.NoError(t, err)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: got %d, want %d", what, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// eventually waits up to 10 s for cond to hold.
func eventually(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// deliveryCount returns the delivery count in the context of delivered message m.
func deliveryCount(t *testing.T, m *message.Message) int {
	t.Helper()
	info, ok := redelivery.FromContext(m.Context())
	require.True(t, ok, "message %s carries no redelivery.Info", m.UUID)
	require.True(t, info.DelaysNacks)
	return info.Count
}
