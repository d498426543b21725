package sqlqueue_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestPubSub runs watermill's universal Pub/Sub suite against the queue on PostgreSQL and
// MariaDB, each in a database of its own; every test of the suite uses topics of its own.
// Every constructor call makes a Queue and Subscriber of its own over the database, as
// separate processes would.
//
// Features:
//   - ConsumerGroups is true: every group receives every message, and within a group a
//     message is leased to one subscription at a time.
//   - ExactlyOnceDelivery is false: delivery is at least once. A message whose lease passes
//     before its ack is written, or whose consumer dies, is delivered again. With it false
//     the suite also runs TestContinueAfterSubscribeClose and TestConcurrentClose.
//   - GuaranteedOrder is false: up to Prefetch deliveries are in flight and settle in any
//     order, and a nacked message comes back after the ones behind it. That also skips
//     TestNoAck, which demands that nothing more arrives before an ack.
//   - Persistent is true: messages are rows in the database.
//   - NewSubscriberReceivesOldMessages is false: a new subscription of a group starts at the
//     group's cursor; the queue is not a log that each subscriber replays.
//   - RestartServiceCommand is empty, so TestReconnect is skipped: the database servers are
//     shared with other tests and are not restarted; a lost connection is covered by
//     TestSubscriber_LostConnectionRedeliversWhatWasInFlightAndGoesOn, which cuts it.
//   - ContextPreserved is false: a message's context is not stored.
//
// Each database runs it with a consumer that settles directly (the suite's acks and nacks are
// followed by redelivery.Settle, see settlingSubscriber); PostgreSQL also with one that does
// not (forEachDatabase says why one database is enough). PostgreSQL settling directly, the
// router's way, runs the suite at its full sizes; the other two at its short sizes, which
// take a minute less each.
func TestPubSub(t *testing.T) {
	t.Parallel()
	for i, d := range databases {
		forEachMode(t, d.name+"-", i == 0, func(t *testing.T, direct bool) {
			run := testsvc.PubSubShort
			if i == 0 && direct {
				run = testsvc.PubSub
			}
			db := openDB(t, d.url(t))
			// The suite's tests run in parallel; keep within the servers' connection limits.
			db.SetMaxOpenConns(40)
			withGroup := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
				q, err := sqlqueue.New(db.DB.DB, db.Dialect, sqlqueue.Config{
					ConsumerGroup: group,
					PollInterval:  10 * time.Millisecond,
					AckTimeout:    10 * time.Second,
				})
				require.NoError(t, err)
				pub, err := q.NewPublisher()
				require.NoError(t, err)
				if direct {
					return pub, testsvc.NewSettlingSubscriber(q.Subscriber())
				}
				return pub, q.Subscriber()
			}
			run(t, "", withGroup)
		})
	}
}
