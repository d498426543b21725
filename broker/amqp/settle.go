package amqp

import (
	"container/heap"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// This file settles a session's deliveries: acks coalesced into frames, nacks sent at once or
// held until their redelivery delay has passed.

// settlement is the consumer's ack or nack of a delivery.
type settlement struct {
	d   *delivery
	ack bool
}

// settle handles the consumer's ack or nack of a delivery. mu is held.
func (ss *session) settle(st settlement) error {
	d := st.d
	if ss.inflight[d.tag] != d {
		return nil // settled already, by the sweep of end
	}
	delete(ss.inflight, d.tag)
	d.cancel()
	if st.ack {
		now := time.Now()
		var took time.Duration
		if !d.out.IsZero() {
			took = now.Sub(d.out)
		} // else settled directly before run recorded the hand-out: at once
		return ss.send(ss.acked.ack(d.tag, now, took))
	}
	delay, asked := redelivery.RequestedDelay(d.ctx)
	if !asked {
		delay = ss.sub.s.cfg.NackDelay
	}
	if delay <= 0 {
		return ss.nack(d)
	}
	d.due = time.Now().Add(delay)
	heap.Push(&ss.held, d)
	ss.resetNackTimer()
	return ss.send(ss.acked.holdNack(d.tag))
}

// send sends the acks the coalescer returned, and sets the timer for the ones that wait. mu is
// held.
func (ss *session) send(frames []ackFrame) error {
	for _, f := range frames {
		if err := ss.acks.Ack(f.tag, f.multiple); err != nil {
			return fmt.Errorf("ack delivery %d (multiple=%t): %w", f.tag, f.multiple, err)
		}
	}
	due, ok := ss.acked.due()
	switch {
	case !ok:
		if !ss.ackDue.IsZero() {
			ss.ackTimer.Stop()
			ss.ackDue = time.Time{}
		}
	case !due.Equal(ss.ackDue):
		ss.ackTimer.Reset(time.Until(due))
		ss.ackDue = due
	}
	return nil
}

// nack gives d back to RabbitMQ, to be delivered again. mu is held.
func (ss *session) nack(d *delivery) error {
	if err := ss.acks.Nack(d.tag, false, true); err != nil {
		return fmt.Errorf("nack delivery %d: %w", d.tag, err)
	}
	return ss.send(ss.acked.settle(d.tag))
}

// nackDue sends the held nacks whose delay has passed at now. mu is held.
func (ss *session) nackDue(now time.Time) error {
	for len(ss.held) > 0 && !ss.held[0].due.After(now) {
		if err := ss.nack(heap.Pop(&ss.held).(*delivery)); err != nil {
			return err
		}
	}
	ss.resetNackTimer()
	return nil
}

// resetNackTimer sets the nack timer for the first held nack. mu is held.
func (ss *session) resetNackTimer() {
	ss.nackTime.Stop()
	if len(ss.held) > 0 {
		ss.nackTime.Reset(time.Until(ss.held[0].due))
	}
}

// heldQueue is a min-heap of held deliveries by due time.
type heldQueue []*delivery

func (h heldQueue) Len() int           { return len(h) }
func (h heldQueue) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h heldQueue) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *heldQueue) Push(x any)        { *h = append(*h, x.(*delivery)) }
func (h *heldQueue) Pop() any {
	old := *h
	d := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return d
}
