package sqlitequeue

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// delivery is one message claimed by a subscription under one lease.
type delivery struct {
	offset     int64
	deliveries int      // the lease's count, which names the lease
	claim      claimRef // the claim row that holds the lease; zero for a lease row
	msg        *message.Message
	ctx        context.Context // the message's context, as the subscription made it
	cancel     context.CancelFunc
	expires    time.Time // when the lease passes; ctx ends then
	// handed is set by the hand-out goroutine once the message is the consumer's. The
	// subscription's loop reads it after an event from that goroutine or from the watcher it
	// started, or after the goroutine has ended.
	handed atomic.Bool

	// For a consumer that settles directly (redelivery.SettlesDirectly), the delivery ends
	// once, by the first of its Settle and the end of its context: taken says it has ended,
	// stop unregisters the watch of its context (context.AfterFunc) that the hand-out
	// goroutine registered.
	mu    sync.Mutex
	taken bool
	stop  func() bool
}

// newDelivery makes the delivery of msg, claimed as r, under a lease claimed until expires. The message's
// context derives from parent, ends when the lease passes, and carries a redelivery.Info with
// the lease's count. With settled not nil, the consumer settles the message directly
// (redelivery.Settle), and settled then runs once, in the consumer's goroutine, unless the
// context of the delivery ended before; flush runs on redelivery.Flush.
func newDelivery(parent context.Context, msg *message.Message, r claimedRow, expires time.Time, settled func(*delivery), flush func()) *delivery {
	ctx, cancel := context.WithDeadline(parent, expires)
	info := redelivery.Info{Count: r.deliveries, DelaysNacks: true}
	d := &delivery{offset: r.offset, deliveries: r.deliveries, claim: r.claim, msg: msg, cancel: cancel, expires: expires}
	if settled != nil {
		ctx = redelivery.NewDeliveryContext(ctx, info, func() {
			if d.take() {
				settled(d)
			}
		}, flush)
	} else {
		ctx = redelivery.NewContext(ctx, info)
	}
	d.ctx = ctx
	msg.SetContext(ctx)
	return d
}

// watchEnd arranges, for a consumer that settles directly, that ended runs once the delivery's
// context ends (its lease passes, or the subscription ends) before the consumer settles it. The
// hand-out goroutine calls it when it hands the message out.
func (d *delivery) watchEnd(ended func(*delivery)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.taken {
		return
	}
	d.stop = context.AfterFunc(d.ctx, func() {
		if d.take() {
			ended(d)
		}
	})
}

// take reports whether the delivery had not ended yet, and ends it. The watch of its context
// is unregistered, so that cancelling the context starts no goroutine.
func (d *delivery) take() bool {
	d.mu.Lock()
	if d.taken {
		d.mu.Unlock()
		return false
	}
	d.taken = true
	stop := d.stop
	d.mu.Unlock()
	if stop != nil {
		stop()
	}
	return true
}

// outcome is what the consumer did with a delivery.
type outcome int

const (
	// unsettled: neither acknowledged nor nacked (yet).
	unsettled outcome = iota
	acked
	nacked
)

// outcomeNow returns the delivery's outcome so far, without waiting.
func (d *delivery) outcomeNow() outcome {
	select {
	case <-d.msg.Acked():
		return acked
	default:
	}
	select {
	case <-d.msg.Nacked():
		return nacked
	default:
	}
	return unsettled
}

// settlement returns the settlement of the delivery's lease for outcome o, given at time at:
// deleted when acked, visible again after the nack's delay (the one NackAfter asked for, else
// resend) when nacked, visible again at once (given back) when unsettled.
func (d *delivery) settlement(o outcome, at time.Time, resend time.Duration) settlement {
	s := settlement{offset: d.offset, deliveries: d.deliveries, claim: d.claim}
	switch o {
	case acked:
		s.ack = true
	case nacked:
		delay, ok := redelivery.RequestedDelay(d.ctx)
		if !ok {
			delay = resend
		}
		s.visibleAt = at.Add(delay)
	default:
		s.visibleAt = at
		s.undeliver = !d.handed.Load()
	}
	return s
}
