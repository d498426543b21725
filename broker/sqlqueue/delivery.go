package sqlqueue

import (
	"context"
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/broker/redelivery"
)

// errLeasePassed ends a delivery whose lease passed unsettled: the message is due, and the
// next claim of any subscription of the group takes it. It is a context.DeadlineExceeded.
var errLeasePassed = fmt.Errorf("sqlqueue: the lease passed: %w", context.DeadlineExceeded)

// Settle hands the end of a delivery to the settler: an ack deletes the lease, also a late one
// (the lease then still names this delivery if nobody claimed the message since); a nack
// makes it visible after its delay; a delivery that ended unsettled is given back, its count
// taken back if it was never handed out, unless its lease passed after the hand-out: the
// message is due already.
func (sub *subscription) Settle(d *inflight.Delivery[leaseRef], o inflight.Outcome) {
	switch {
	case o.Acked:
		sub.ack(d.Data)
	case o.Nacked:
		sub.update(leaseUpdate{leaseRef: d.Data, delay: o.Delay})
	default:
		handed := d.HandedOut()
		if handed && errors.Is(o.Cause, errLeasePassed) {
			return
		}
		u := leaseUpdate{leaseRef: d.Data}
		if !handed {
			u.delta = -1
		}
		sub.update(u)
	}
}

// ack queues the deletion of lease r for the Subscriber's settler.
func (sub *subscription) ack(r leaseRef) {
	sub.s.settler.Add(settlement{topic: sub.topic, ack: true, leaseUpdate: leaseUpdate{leaseRef: r}})
}

// update queues the lease change u for the Subscriber's settler.
func (sub *subscription) update(u leaseUpdate) {
	sub.s.settler.Add(settlement{topic: sub.topic, leaseUpdate: u})
}

// Context gives each delivery the redelivery.TxAck of its lease, which deletes the lease in the
// caller's transaction while it is this delivery's; the router's acknowledgement after the
// commit then finds no lease, and changes nothing.
func (sub *subscription) Context(ctx context.Context, d *inflight.Delivery[leaseRef]) context.Context {
	ref := d.Data
	return redelivery.WithTxAck(ctx, func(ctx context.Context, tx redelivery.Execer) (bool, error) {
		n, err := dbqueue.Affected(tx.ExecContext(ctx, sub.ackStmt, sub.q.cfg.ConsumerGroup, ref.offset, ref.deliveries))
		if err != nil {
			return false, fmt.Errorf("sqlqueue: acknowledge offset %d of %s in the transaction: %w", ref.offset, sub.topic, err)
		}
		return n == 1, nil
	})
}
