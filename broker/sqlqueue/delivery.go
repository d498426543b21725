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
	// lease, for a consumer that settles directly, is the claim's lease the delivery shares.
	lease *claimLease
}

// claimLease is the lease of the deliveries of one claim, for a consumer that settles
// directly: their contexts derive from its context, which ends at their common deadline, and
// one callback then frees the places of the handed-out ones still unsettled. No goroutine or
// timer per delivery waits for the lease.
type claimLease struct {
	ctx    context.Context
	cancel context.CancelFunc
	stop   func() bool // stops the callback
	ds     []*delivery
	// open counts the deliveries not settled by the consumer; the subscription's mutex
	// guards it. The last settlement ends the lease's context early.
	open int
}

// newClaimLease returns the lease of a claim whose leases run until deadline.
func (sub *subscription) newClaimLease(deadline time.Time) *claimLease {
	ctx, cancel := context.WithDeadline(sub.ctx, deadline)
	return &claimLease{ctx: ctx, cancel: cancel}
}

// watch starts the callback of the lease, once its deliveries are made.
func (l *claimLease) watch(sub *subscription) {
	if len(l.ds) == 0 {
		l.cancel()
		return
	}
	l.stop = context.AfterFunc(l.ctx, func() {
		if !errors.Is(l.ctx.Err(), context.DeadlineExceeded) {
			return
		}
		sub.mu.Lock()
		defer sub.mu.Unlock()
		for _, d := range l.ds {
			if d.handedOut {
				d.expireLocked()
			} // one not handed out yet is given back by handOut
		}
	})
}

// passed reports whether the lease passed.
func (l *claimLease) passed() bool { return errors.Is(l.ctx.Err(), context.DeadlineExceeded) }

// newDelivery makes the delivery of r, whose lease runs until deadline, and takes its place
// in the window. For a consumer that settles directly, the delivery shares the claim's lease l.
func (sub *subscription) newDelivery(r row, deadline time.Time, l *claimLease) *delivery {
	var ctx context.Context
	var cancel context.CancelFunc
	if l != nil {
		ctx, cancel = context.WithCancel(l.ctx)
	} else {
		ctx, cancel = context.WithDeadline(sub.ctx, deadline)
	}
	msg := newMessage(r.uuid, r.payload, r.metadata)
	info := redelivery.Info{Count: r.deliveries, DelaysNacks: true}
	rctx := redelivery.WithTxAck(ctx, sub.txAck(leaseRef{offset: r.offset, deliveries: r.deliveries}))
	d := &delivery{sub: sub, ref: leaseRef{offset: r.offset, deliveries: r.deliveries}, msg: msg, ctx: ctx, cancel: cancel, lease: l}
	if l != nil {
		rctx = redelivery.NewDeliveryContext(rctx, info, d.settleDirect, sub.flush)
		l.ds = append(l.ds, d)
	} else {
		rctx = redelivery.NewContext(rctx, info)
	}
	msg.SetContext(rctx)
	sub.mu.Lock()
	sub.held[d] = struct{}{}
	if l != nil {
		l.open++
	}
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

// settleDirect takes the consumer's ack or nack of d, in the consumer's goroutine
// (redelivery.Settle).
func (d *delivery) settleDirect() {
	d.settle(redelivery.Acked(d.msg))
	d.cancel()
	l := d.lease
	d.sub.mu.Lock()
	l.open--
	last := l.open == 0
	d.sub.mu.Unlock()
	if last {
		l.stop() // before the cancel, which would run it
		l.cancel()
	}
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
	d.sub.mu.Lock()
	defer d.sub.mu.Unlock()
	d.expireLocked()
}

// expireLocked is expire with the subscription's mutex held.
func (d *delivery) expireLocked() {
	if d.state == live {
		d.state = expired
		d.sub.leave(d, live)
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
