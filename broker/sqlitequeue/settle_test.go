package sqlitequeue_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// A message nacked and settled directly comes back after its delay with its count up by one,
// and the message behind it is not held up meanwhile.
func TestSubscriber_DirectSettleNackComesBackWithCountPlusOne(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 1, ResendInterval: 50 * time.Millisecond})
	ids := publishN(t, q, "t", 2)
	msgs := subscribe(t, q, redelivery.WithDirectSettle(context.Background()), "t")

	m := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], m.UUID)
	require.True(t, m.Nack())
	redelivery.Settle(m)
	behind := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[1], behind.UUID, "the nacked message does not block the one behind it")
	require.True(t, behind.Ack())
	redelivery.Settle(behind)
	again := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], again.UUID)
	require.Equal(t, 2, deliveryCount(t, again))
	require.True(t, again.Ack())
	redelivery.Settle(again)
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(context.Background(), "t", "g") }, "backlog")
}

// A message that a directly settling consumer neither settles nor acks within the ack deadline
// has its context cancelled and is delivered again, with its count up by one; a Settle after
// that does nothing to the new delivery.
func TestSubscriber_DirectSettleUnsettledLeaseExpires(t *testing.T) {
	t.Parallel()
	q := setup(t, sqlitequeue.Config{ConsumerGroup: "g", BatchSize: 1, AckDeadline: 100 * time.Millisecond})
	ids := publishN(t, q, "t", 1)
	msgs := subscribe(t, q, redelivery.WithDirectSettle(context.Background()), "t")

	m := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, 1, deliveryCount(t, m))
	select {
	case <-m.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the context of the unsettled message did not end with its lease")
	}
	again := testsvc.Receive(t, msgs, 5*time.Second)
	require.Equal(t, ids[0], again.UUID)
	require.Equal(t, 2, deliveryCount(t, again))
	require.True(t, m.Ack())
	redelivery.Settle(m) // the earlier delivery's: too late, and harmless
	require.True(t, again.Ack())
	redelivery.Settle(again)
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(context.Background(), "t", "g") }, "backlog")
}
