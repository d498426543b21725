package kafka

import (
	"context"
	"errors"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// This file books how a subscription's deliveries end, as the engine tells them, and ends the
// subscription.

// Settle books how a delivery ended. An ack marks its entry acked: the partition's commit mark
// may move, and in order the next record may go out. A nack leaves the deliveries in flight as
// its hold begins (Outcome.Held), and is queued again when the hold ends; a delivery whose
// AckTimeout passed is queued again at once. One that ended with the subscription, or with its
// partition, leaves its entry unacked, for the next owner.
func (sub *subscription) Settle(x *inflight.Delivery[*delivery], o inflight.Outcome) {
	d := x.Data
	p := d.p
	sub.mu.Lock()
	defer sub.mu.Unlock()
	sub.unliveLocked(d)
	if p.gone {
		return
	}
	if o.Acked {
		d.e.acked, d.e.rec = true, nil
		p.popAcked()
		p.acks++
		inflight.Signal(sub.commit)
		if sub.positions != nil && sub.releaseLocked(p) {
			sub.pumpLocked()
		}
		return
	}
	d.e.out = false
	again := o.Cause == nil && o.Nacked && !o.Held || errors.Is(o.Cause, ErrAckTimeout)
	if !again || sub.sub.Stopped() || p.revoking {
		return
	}
	if _, queued := sub.queueLocked(p, d.e); queued {
		sub.pumpLocked()
	} else {
		inflight.Signal(sub.commit) // it waits for the commit that records it
	}
}

// Close runs once the engine has told every delivery how it ended: it waits for the commits
// to stop, commits what is acked and drops the books (release), and leaves the group, so that
// its partitions move at once.
func (sub *subscription) Close(ctx context.Context) error {
	sub.loops.Wait()
	if err := sub.release(ctx, nil, true); err != nil {
		sub.logger.Error("Cannot commit the offsets of the acked records on close: the group delivers them again", err, nil)
	}
	sub.cl.Close() // leaving the group revokes the partitions, which are out of the books
	return nil
}
