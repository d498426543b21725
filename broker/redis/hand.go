package redis

import (
	"time"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// hand holds the deliveries in flight of a subscription whose consumer settles each message
// itself (redelivery.WithDirectSettle): it calls redelivery.Settle right after every ack or
// nack, and the delivery leaves the window then, in the consumer's goroutine (settled). No
// delivery has a goroutine or a timer of its own: the hand keeps them in the order of their
// deadlines (AckTimeout after the command that made them ours, which is the order they were
// registered in), and one timer ends those whose deadline passes (expire); a lost connection
// and the end of the subscription end them all at once (endHand). An ack or nack given before
// a delivery ends counts, as it does for a watched delivery.
//
// A delivery leaves the hand once (delivery.left), by whichever comes first; a later Settle
// does nothing.
type hand struct {
	head, tail *delivery // by deadline, earliest first
	timer      *time.Timer
	armed      time.Time // when timer fires; zero when it is stopped
}

// hold puts d, just registered, in the hand, to end unsettled at deadline. The caller holds
// mu.
func (s *subscription) hold(d *delivery, deadline time.Time) {
	h := &s.hand
	d.deadline = deadline
	d.prev = h.tail
	if h.tail == nil {
		h.head = d
	} else {
		h.tail.next = d
	}
	h.tail = d
	if h.armed.IsZero() || deadline.Before(h.armed) {
		h.armed = deadline
		h.timer.Reset(time.Until(deadline))
	}
}

// unhold takes d out of the hand. The caller holds mu.
func (s *subscription) unhold(d *delivery) {
	h := &s.hand
	if d.prev == nil {
		if h.head != d {
			return // not in the hand
		}
		h.head = d.next
	} else {
		d.prev.next = d.next
	}
	if d.next == nil {
		h.tail = d.prev
	} else {
		d.next.prev = d.prev
	}
	d.prev, d.next = nil, nil
}

// settled is d's function for redelivery.Settle: d leaves the window as the consumer acked or
// nacked it, unless it has ended already.
func (s *subscription) settled(d *delivery) {
	acked := redelivery.Acked(d.msg)
	s.mu.Lock()
	if d.left {
		s.mu.Unlock()
		return
	}
	p, acked := s.leave(d, acked, !acked)
	if p != nil {
		s.watchers.Add(1) // before stop can wait for the parks
	}
	s.mu.Unlock()
	s.afterLeave(d, p, acked)
	if p != nil {
		// Parking is a command to Redis: not in the consumer's goroutine.
		go func() {
			defer s.watchers.Done()
			s.park(p)
		}()
	}
}

// expire ends the deliveries whose deadline has passed, and sets the timer for the next one.
func (s *subscription) expire() {
	now := time.Now()
	s.mu.Lock()
	h := &s.hand
	h.armed = time.Time{}
	var due []*delivery
	acked := false
	for h.head != nil && !h.head.deadline.After(now) {
		due = append(due, h.head)
		acked = s.end(h.head) || acked
	}
	if h.head != nil {
		h.armed = h.head.deadline
		h.timer.Reset(time.Until(h.armed))
	}
	s.mu.Unlock()
	s.afterEnd(due, acked)
}

// endHand ends every delivery in the hand: the subscription stops or lost its connection.
func (s *subscription) endHand() {
	s.mu.Lock()
	var ended []*delivery
	acked := false
	for s.hand.head != nil {
		ended = append(ended, s.hand.head)
		acked = s.end(s.hand.head) || acked
	}
	s.hand.armed = time.Time{}
	s.hand.timer.Stop()
	s.mu.Unlock()
	s.afterEnd(ended, acked)
}

// end takes d, whose delivery ends, out of the window with the ack or nack given before, if
// any, and reports whether it was acked. The caller holds mu, and then calls afterEnd.
func (s *subscription) end(d *delivery) bool {
	var acked, nacked bool
	select {
	case <-d.msg.Acked():
		acked = true
	case <-d.msg.Nacked():
		nacked = true
	default:
	}
	p, acked := s.leave(d, acked, nacked)
	if p != nil {
		s.watchers.Add(1)
		go func() {
			defer s.watchers.Done()
			s.park(p)
		}()
	}
	return acked
}

// afterEnd ends the contexts of the deliveries that end took out of the window, and wakes the
// read loop, and the flush of the acks when one of them was acked.
func (s *subscription) afterEnd(ended []*delivery, acked bool) {
	for _, d := range ended {
		d.cancel()
	}
	if len(ended) > 0 {
		signal(s.room)
	}
	if acked {
		signal(s.ackReady)
	}
}
