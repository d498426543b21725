package kafka

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// This file books the settlement of a subscription's deliveries: watched, or taken directly
// from a consumer that settles each message itself; a nacked record is queued again after its
// delay.

// watch waits for the settlement of one delivery.
func (sub *subscription) watch(d *delivery, ctx context.Context) {
	defer sub.watchers.Done()
	defer d.cancel(nil)
	timer := time.NewTimer(sub.s.cfg.AckTimeout)
	defer timer.Stop()
	select {
	case <-d.msg.Acked():
		sub.settle(d, true, 0, nil)
	case <-d.msg.Nacked():
		delay := sub.s.cfg.NackDelay
		if rd, ok := redelivery.RequestedDelay(d.msg.Context()); ok {
			delay = rd
		}
		sub.settle(d, false, delay, nil)
	case <-timer.C:
		sub.settle(d, false, 0, ErrAckTimeout)
	case <-ctx.Done():
		// An ack given before the delivery ended counts.
		select {
		case <-d.msg.Acked():
			sub.settle(d, true, 0, nil)
		default:
			sub.mu.Lock()
			sub.unliveLocked(d)
			sub.mu.Unlock()
		}
	}
}

// settled is the settle function of d in a subscription whose consumer settles directly
// (redelivery.Settle): it books d's ack or nack, then ends the delivery's context.
func (sub *subscription) settled(d *delivery) {
	if redelivery.Acked(d.msg) {
		sub.settle(d, true, 0, nil)
	} else {
		delay := sub.s.cfg.NackDelay
		if rd, ok := redelivery.RequestedDelay(d.msg.Context()); ok {
			delay = rd
		}
		sub.settle(d, false, delay, nil)
	}
	d.cancel(nil)
}

// settleAcked books, in a subscription whose consumer settles directly and that is ending, the
// acks given before the end whose Settle has not come yet: as watch does, an ack given before
// the delivery ended counts.
func (sub *subscription) settleAcked() {
	var acked []*delivery
	sub.mu.Lock()
	for _, p := range sub.parts {
		for d := range p.live {
			if redelivery.Acked(d.msg) {
				acked = append(acked, d)
			}
		}
	}
	sub.mu.Unlock()
	for _, d := range acked {
		sub.settle(d, true, 0, nil)
	}
}

// settle books the ack or nack of d. A nacked record is queued again after delay; cause, if
// not nil, ends the delivery's context first.
func (sub *subscription) settle(d *delivery, ack bool, delay time.Duration, cause error) {
	if cause != nil {
		d.cancel(cause)
	}
	sub.mu.Lock()
	defer sub.mu.Unlock()
	p := d.p
	if d.settled || p.gone {
		return
	}
	d.settled = true
	if d.timer != nil {
		d.timer.Stop()
	}
	sub.unliveLocked(d)
	p.inflight--
	sub.inflight--
	signal(sub.room)
	if ack {
		d.e.acked, d.e.rec = true, nil
		p.popAcked()
		p.acks++
		sub.gate.acked(1)
		signal(sub.commit)
		if sub.positions != nil && sub.releaseLocked(p) {
			signal(sub.wake)
		}
		return
	}
	d.e.out = false
	if sub.done || p.revoking {
		return // it stays unacked: its partition's next owner delivers it again
	}
	e := d.e
	if delay <= 0 {
		sub.enqueueLocked(p, e)
		return
	}
	var t *time.Timer
	t = time.AfterFunc(delay, func() {
		sub.mu.Lock()
		defer sub.mu.Unlock()
		delete(sub.timers, t)
		if !p.gone && !p.revoking && !sub.done {
			sub.enqueueLocked(p, e)
		}
	})
	sub.timers[t] = struct{}{}
}

// unliveLocked takes d off its partition's deliveries in flight; sub.mu is held.
func (sub *subscription) unliveLocked(d *delivery) {
	p := d.p
	if _, ok := p.live[d]; !ok {
		return
	}
	delete(p.live, d)
	if d.timer != nil {
		d.timer.Stop()
	}
	sub.gate.leave(d.alone)
	if len(p.live) == 0 && p.drained != nil {
		close(p.drained)
		p.drained = nil
	}
}
