package sqlqueue

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// deliveryState is where a delivery stands. Its subscription's mutex guards it.
type deliveryState int

const (
	// live: claimed, not settled, lease running; it takes a place in the prefetch window.
	live deliveryState = iota
	// expired: the lease passed before the delivery was settled. A late ack is still
	// written: it deletes the lease if no one has claimed the message since.
	expired
	// givenBack: the subscription ended and made the lease visible again. A late ack is
	// still written; a late nack is not, so that it does not delay what was given back.
	givenBack
	// settled: acked or nacked, and written or being written.
	settled
)

// delivery is one claim of a message by a subscription, from the claim to its settlement.
type delivery struct {
	sub    *subscription
	ref    leaseRef
	msg    *message.Message
	ctx    context.Context
	cancel context.CancelFunc

	// The subscription's mutex guards the fields below.
	state     deliveryState
	handedOut bool
	// stopExpiry, for a consumer that settles directly, stops the watch of the lease
	// (watchLease); nil before the hand-out and after the settlement.
	stopExpiry func() bool
}

// newDelivery makes the delivery of r, whose lease runs until deadline, and takes its place
// in the window.
func (sub *subscription) newDelivery(r row, deadline time.Time) *delivery {
	ctx, cancel := context.WithDeadline(sub.ctx, deadline)
	msg := newMessage(r.uuid, r.payload, r.metadata)
	rctx := redelivery.NewContext(ctx, redelivery.Info{Count: r.deliveries, DelaysNacks: true})
	rctx = redelivery.WithTxAck(rctx, sub.txAck(leaseRef{offset: r.offset, deliveries: r.deliveries}))
	d := &delivery{sub: sub, ref: leaseRef{offset: r.offset, deliveries: r.deliveries}, msg: msg, ctx: ctx, cancel: cancel}
	if sub.direct {
		rctx = redelivery.NewSettleContext(rctx, d.settleDirect)
	}
	msg.SetContext(rctx)
	sub.mu.Lock()
	sub.held[d] = struct{}{}
	sub.mu.Unlock()
	return d
}

// watch waits for the consumer to settle the handed-out delivery, and for its lease to pass.
func (d *delivery) watch() {
	defer d.cancel()
	select {
	case <-d.msg.Acked():
		d.settle(true)
		return
	case <-d.msg.Nacked():
		d.settle(false)
		return
	case <-d.ctx.Done():
		if errors.Is(d.ctx.Err(), context.DeadlineExceeded) {
			d.expire()
		}
	}
	// The consumer may still settle it, and an ack then spares a redelivery.
	select {
	case <-d.msg.Acked():
		d.settle(true)
	case <-d.msg.Nacked():
		d.settle(false)
	case <-d.sub.s.closing:
	}
}

// watchLease, for a consumer that settles directly, frees the place of the handed-out delivery
// when its lease passes unsettled, as watch does, without a goroutine until then. The
// subscription's mutex is held.
func (d *delivery) watchLease() {
	if d.state == settled {
		return // settled before the hand-out was recorded
	}
	d.stopExpiry = context.AfterFunc(d.ctx, func() {
		if errors.Is(d.ctx.Err(), context.DeadlineExceeded) {
			d.expire()
		}
	})
}

// settleDirect takes the consumer's ack or nack of d, in the consumer's goroutine
// (redelivery.Settle).
func (d *delivery) settleDirect() {
	d.sub.mu.Lock()
	stop := d.stopExpiry
	d.stopExpiry = nil
	d.sub.mu.Unlock()
	if stop != nil {
		stop()
	}
	d.settle(redelivery.Acked(d.msg))
	d.cancel()
}

// settle records the consumer's ack or nack for writing.
func (d *delivery) settle(acked bool) {
	sub := d.sub
	sub.mu.Lock()
	was := d.state
	if was == settled || (was == givenBack && !acked) {
		sub.mu.Unlock()
		return
	}
	d.state = settled
	sub.leave(d, was)
	sub.mu.Unlock()
	if acked {
		sub.s.settler.ack(sub.topic, d.ref)
		return
	}
	delay, ok := redelivery.RequestedDelay(d.msg.Context())
	if !ok {
		delay = sub.s.q.cfg.NackDelay
	}
	sub.s.settler.update(sub.topic, leaseUpdate{leaseRef: d.ref, delay: delay})
}

// expire frees the place of a delivery whose lease passed unsettled: the message is due, and
// the next claim of any subscription of the group takes it.
func (d *delivery) expire() {
	sub := d.sub
	sub.mu.Lock()
	defer sub.mu.Unlock()
	if d.state == live {
		d.state = expired
		sub.leave(d, live)
	}
}

// giveBack makes the lease of an unsettled delivery visible again at once; one that was never
// handed out gets its delivery count back as well. The subscription's mutex is held.
func (d *delivery) giveBackLocked() {
	delta := 0
	if !d.handedOut {
		delta = -1
	}
	was := d.state
	d.state = givenBack
	d.sub.leave(d, was)
	d.sub.s.settler.update(d.sub.topic, leaseUpdate{leaseRef: d.ref, delta: delta})
}

// txAck returns the redelivery.TxAck of the lease ref: it deletes the lease in the caller's
// transaction, while the lease is the one this delivery holds (no consumer has claimed the
// message since). The acknowledgement the router gives after the commit then finds no lease,
// and changes nothing.
func (sub *subscription) txAck(ref leaseRef) redelivery.TxAck {
	q := sub.s.q
	stmt := q.d.ackInTx(sub.topic)
	return func(ctx context.Context, tx redelivery.Execer) (bool, error) {
		r, err := tx.ExecContext(ctx, stmt, q.cfg.ConsumerGroup, ref.offset, ref.deliveries)
		if err != nil {
			return false, fmt.Errorf("sqlqueue: acknowledge offset %d of %s in the transaction: %w", ref.offset, sub.topic, err)
		}
		n, err := r.RowsAffected()
		if err != nil {
			return false, fmt.Errorf("sqlqueue: acknowledge offset %d of %s in the transaction: %w", ref.offset, sub.topic, err)
		}
		return n == 1, nil
	}
}
