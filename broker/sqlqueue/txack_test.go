package sqlqueue_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestTxAck_DeletesTheLeaseInTheCallersTransactionWhileItIsTheDeliverys(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		q := e.queue(sqlqueue.Config{})
		tp := topic()
		e.publish(q, tp, "m", 2)
		sub, ch := e.subscribe(q, tp)
		require.True(t, sub.AcksInTransaction())

		first := receive(t, ch)
		txAck, ok := redelivery.TxAckFrom(first.Context())
		require.True(t, ok, "every message carries its TxAck")

		// Rolled back: the lease stays, and the message comes back after its nack.
		tx, err := e.db.BeginTxx(ctx, nil)
		require.NoError(t, err)
		owned, err := txAck(ctx, tx)
		require.NoError(t, err)
		require.True(t, owned)
		require.NoError(t, tx.Rollback())
		nack(first)
		again := receive(t, ch)
		for again.UUID != first.UUID {
			ack(again)
			again = receive(t, ch)
		}

		// The first delivery's lease is gone (claimed again): its TxAck no longer owns it.
		tx, err = e.db.BeginTxx(ctx, nil)
		require.NoError(t, err)
		owned, err = txAck(ctx, tx)
		require.NoError(t, err)
		require.False(t, owned, "a lease claimed again is the new delivery's")
		require.NoError(t, tx.Rollback())

		// Committed: the message is consumed, and the router's ack after it changes nothing.
		ackAgain, _ := redelivery.TxAckFrom(again.Context())
		tx, err = e.db.BeginTxx(ctx, nil)
		require.NoError(t, err)
		owned, err = ackAgain(ctx, tx)
		require.NoError(t, err)
		require.True(t, owned)
		require.NoError(t, tx.Commit())
		ack(again)
		testsvc.RequireNothing(t, ch, 300*time.Millisecond)
		var leases int
		require.NoError(t, e.db.Get(&leases, `SELECT COUNT(*) FROM `+e.leasesTable(tp)))
		require.Zero(t, leases)
	})
}
