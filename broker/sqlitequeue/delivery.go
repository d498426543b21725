package sqlitequeue

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// delivery is one message claimed by a subscription under one lease.
type delivery struct {
	offset     int64
	deliveries int // the lease's count, which names the lease
	msg        *message.Message
	ctx        context.Context // the message's context, as the subscription made it
	cancel     context.CancelFunc
	expires    time.Time // when the lease passes; ctx ends then
	// handed is set by the hand-out goroutine once the message is the consumer's. The
	// subscription's loop reads it after an event from that goroutine or from the watcher it
	// started, or after the goroutine has ended.
	handed atomic.Bool
}

// newDelivery makes the delivery of msg under a lease claimed until expires. The message's
// context derives from parent, ends when the lease passes, and carries a redelivery.Info with
// the lease's count.
func newDelivery(parent context.Context, msg *message.Message, offset int64, deliveries int, expires time.Time) *delivery {
	ctx, cancel := context.WithDeadline(parent, expires)
	ctx = redelivery.NewContext(ctx, redelivery.Info{Count: deliveries, DelaysNacks: true})
	msg.SetContext(ctx)
	return &delivery{offset: offset, deliveries: deliveries, msg: msg, ctx: ctx, cancel: cancel, expires: expires}
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
	s := settlement{offset: d.offset, deliveries: d.deliveries}
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
