package sqlitequeue_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestPubSub runs watermill's universal Pub/Sub suite against the queue, with a fresh queue file
// per test. Every constructor call opens a Queue of its own over the test's file, as separate
// processes would.
//
// Features:
//   - ExactlyOnceDelivery is false: delivery is at-least-once. A message whose lease expires
//     while its consumer still works on it is delivered again, and an acknowledgement given
//     just before a consumer dies may not have been committed (acknowledgements are committed
//     a few milliseconds after they are given). With it false the suite also runs
//     TestContinueAfterSubscribeClose and TestConcurrentClose, which it skips otherwise.
//   - GuaranteedOrder is false: a subscription keeps a window of messages in flight, and a
//     nacked or redelivered message comes back after the ones behind it; competing consumers
//     each take messages of the topic. (A single subscription hands out new messages in
//     offset order, but order is not kept across nacks, so
//     GuaranteedOrderWithSingleSubscriber, which only refines GuaranteedOrder, is false too.)
//   - NewSubscriberReceivesOldMessages is false: a new subscriber in a consumer group starts
//     at the group's cursor; the queue is not a log that each subscriber replays.
//   - RestartServiceCommand is empty, so TestReconnect is skipped: there is no server to restart;
//     the equivalent for a file is a consumer process killed mid-delivery, which
//     TestKilledConsumer_DeliveryCountSurvives covers.
//   - ContextPreserved is false: a message's context is not stored.
func TestPubSub(t *testing.T) {
	t.Parallel()
	var files sync.Map // *testing.T -> queue file of that test
	fileOf := func(t *testing.T) string {
		if p, ok := files.Load(t); ok {
			return p.(string)
		}
		p, _ := files.LoadOrStore(t, filepath.Join(t.TempDir(), "queue.db"))
		return p.(string)
	}
	withGroup := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		q, err := sqlitequeue.Open(context.Background(), fileOf(t), sqlitequeue.Config{ConsumerGroup: group})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, q.Close()) })
		sub, err := q.Subscriber()
		require.NoError(t, err)
		return q.Publisher(), sub
	}
	testsvc.PubSub(t, "", withGroup)
}
