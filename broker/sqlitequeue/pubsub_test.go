package sqlitequeue_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// TestPubSub runs watermill's universal Pub/Sub suite against the queue, with a fresh queue file
// per test. Every constructor call opens a Queue of its own over the test's file, as separate
// processes would.
//
// Features:
//   - ExactlyOnceDelivery is false: a subscriber that closes, or whose context ends, in the
//     middle of a batch leaves the acknowledged part of the batch to be delivered again when the
//     offset update cannot run (at-least-once). Consumers of one group never receive a message
//     at the same time (see TestCompetingConsumers), but the suite's exactly-once tests demand
//     more than that. With it false the suite also runs TestContinueAfterSubscribeClose and
//     TestConcurrentClose, which it skips otherwise.
//   - NewSubscriberReceivesOldMessages is false: a new subscriber in a consumer group starts
//     at the group's acknowledged offset; the queue is not a log that each subscriber replays.
//   - RestartServiceCommand is empty, so TestReconnect is skipped: there is no server to restart;
//     the equivalent for a file is a consumer process killed mid-batch, which
//     TestKilledConsumer_RedeliversToNextConsumer covers.
//   - ContextPreserved is false: a message's context is not stored.
//
// The queues use an AckDeadline of 5 s instead of 30 s. A subscription holds the file's write
// lock from reading a batch until the batch ends, also while its first message waits to be
// read; TestMessageCtx subscribes, then publishes two messages from the goroutine that reads
// the subscription only afterwards, so the second publish waits until the unread first
// message's ack deadline gives the lock up.
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
		q, err := sqlitequeue.Open(context.Background(), fileOf(t), sqlitequeue.Config{ConsumerGroup: group, AckDeadline: 5 * time.Second})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, q.Close()) })
		sub, err := q.Subscriber()
		require.NoError(t, err)
		return q.Publisher(), sub
	}
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:                   true,
		ExactlyOnceDelivery:              false,
		GuaranteedOrder:                  true,
		Persistent:                       true,
		NewSubscriberReceivesOldMessages: false,
		ContextPreserved:                 false,
	}, func(t *testing.T) (message.Publisher, message.Subscriber) {
		return withGroup(t, "test")
	}, withGroup)
}
