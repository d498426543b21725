package nats

import (
	"context"
	"sync"
	"time"
)

// hand holds the deliveries of a subscription whose consumer settles each message itself
// (redelivery.WithDirectSettle): it calls redelivery.Settle right after every ack or nack, and
// the delivery is settled then, in the consumer's goroutine (settled). No delivery has a
// goroutine or a timer of its own: one timer of the subscription ends the deliveries whose
// AckWait has passed, the deliveries being kept in the order of their deadlines (the order they
// were handed out in, while AckWait stays the same); a lost connection or the end of the
// subscription ends them all in one sweep.
//
// A delivery leaves the hand once, by whichever comes first: its settlement, its deadline,
// the loss of its connection, or the end of the subscription; only that one tells the server
// and gives the delivery's place of the window back.
type hand struct {
	sub *subscription
	// base is the parent of the deliveries' contexts: the subscription's context without its
	// cancellation, which the hand passes on itself (stop, giveBack), so that the deliveries
	// do not register with the subscription's context one by one.
	base context.Context
	// stopWatch ends the watch of the subscription's context (stop).
	stopWatch func() bool
	// closed is closed when the hand is given back; links is closed when watchLinks returns.
	closed chan struct{}
	links  chan struct{}
	// expired is signalled (not counted) when expire has ended deliveries.
	expired chan struct{}

	mu         sync.Mutex
	head, tail *delivery // by deadline, earliest first
	timer      *time.Timer
	armed      time.Time // when timer fires; zero when it is not set
	done       bool      // given back: the timer is not set again
}

func newHand(sub *subscription) *hand {
	h := &hand{
		sub:     sub,
		base:    context.WithoutCancel(sub.ctx),
		closed:  make(chan struct{}),
		links:   make(chan struct{}),
		expired: make(chan struct{}, 1),
	}
	h.stopWatch = context.AfterFunc(sub.ctx, h.stop)
	go h.watchLinks()
	return h
}

// add takes d into the hand, its deadline AckWait from now. A delivery whose connection is
// lost already ends at once; one that comes as the subscription ends is ended with it, and
// given back with the others.
func (h *hand) add(d *delivery, ackWait time.Duration) {
	d.deadline = time.Now().Add(ackWait)
	h.mu.Lock()
	select {
	case <-d.link.lost:
		h.mu.Unlock()
		d.end(ErrConnectionLost)
		d.release()
		return
	default:
	}
	if h.sub.ctx.Err() != nil {
		d.cancel(context.Cause(h.sub.ctx))
	}
	// Insert by deadline; a delivery is appended, unless AckWait has shrunk since the ones
	// before.
	at := h.tail
	for at != nil && at.deadline.After(d.deadline) {
		at = at.prev
	}
	h.insertAfter(at, d)
	if h.armed.IsZero() || d.deadline.Before(h.armed) {
		h.arm(d.deadline)
	}
	h.mu.Unlock()
}

// handOut hands d to the consumer, unless the delivery ends first: its AckWait passes, its
// connection is lost or the subscription ends. (It waits on what ends deliveries rather than
// on d's context, whose Done channel would cost an allocation per delivery.)
func (h *hand) handOut(d *delivery) {
	for {
		select {
		case h.sub.out <- d.msg:
			return
		case <-d.link.lost:
			return
		case <-h.sub.ctx.Done():
			return
		case <-h.expired:
			h.mu.Lock()
			held := d.held
			h.mu.Unlock()
			if !held {
				return
			}
		}
	}
}

// settled settles d as the consumer acked or nacked it, unless the delivery has ended. Once the
// subscription has ended, the settlement waits for giveBack, which sends it when the
// subscription's pull request has been withdrawn.
func (h *hand) settled(d *delivery) {
	h.mu.Lock()
	if !d.held || h.sub.ctx.Err() != nil {
		h.mu.Unlock()
		return
	}
	h.remove(d)
	h.mu.Unlock()
	if !d.settle() {
		d.nak() // Settle before an ack or nack: take it for a nack
	}
	d.cancel(nil)
	d.release()
}

// expire ends the deliveries whose deadline has passed, and sets the timer for the next one.
func (h *hand) expire() {
	now := time.Now()
	var due []*delivery
	h.mu.Lock()
	for h.head != nil && !h.head.deadline.After(now) {
		d := h.head
		h.remove(d)
		due = append(due, d)
	}
	h.armed = time.Time{}
	if h.head != nil {
		h.arm(h.head.deadline)
	}
	h.mu.Unlock()
	for _, d := range due {
		d.end(ErrAckWaitPassed)
		d.release()
	}
	if len(due) > 0 {
		select {
		case h.expired <- struct{}{}:
		default:
		}
	}
}

// arm sets the timer to fire at at. The caller holds mu.
func (h *hand) arm(at time.Time) {
	if h.done {
		return
	}
	h.armed = at
	if h.timer == nil {
		h.timer = time.AfterFunc(time.Until(at), h.expire)
		return
	}
	h.timer.Reset(time.Until(at))
}

// watchLinks ends the deliveries of each connection that is lost, until the hand is given
// back.
func (h *hand) watchLinks() {
	defer close(h.links)
	for {
		l := h.sub.s.currentLink()
		select {
		case <-l.lost:
			h.lose(l)
		case <-h.closed:
			return
		}
	}
}

// lose ends the deliveries that came on l, a lost connection.
func (h *hand) lose(l *link) {
	var lost []*delivery
	h.mu.Lock()
	for d := h.head; d != nil; {
		next := d.next
		if d.link == l {
			h.remove(d)
			lost = append(lost, d)
		}
		d = next
	}
	h.mu.Unlock()
	for _, d := range lost {
		d.end(ErrConnectionLost)
		d.release()
	}
}

// stop ends the contexts of the deliveries held when the subscription's context ends; they
// stay in the hand until giveBack.
func (h *hand) stop() {
	cause := context.Cause(h.sub.ctx)
	var held []*delivery
	h.mu.Lock()
	for d := h.head; d != nil; d = d.next {
		held = append(held, d)
	}
	h.mu.Unlock()
	for _, d := range held {
		d.cancel(cause)
	}
}

// giveBack ends the deliveries still held once the subscription has ended and its pull request
// is withdrawn: it sends the ack or nack that the consumer gave, or gives the message back (a
// nak); a delivery whose connection was lost is left to the server. It waits for watchLinks to
// return.
func (h *hand) giveBack() {
	h.stopWatch()
	cause := context.Cause(h.sub.ctx)
	h.mu.Lock()
	h.done = true
	if h.timer != nil {
		h.timer.Stop()
	}
	held := h.head
	for d := held; d != nil; d = d.next {
		d.held = false
	}
	h.head, h.tail = nil, nil
	h.mu.Unlock()
	close(h.closed)
	<-h.links
	for d := held; d != nil; d = d.next {
		d.cancel(cause)
		select {
		case <-d.link.lost:
			d.end(ErrConnectionLost)
		default:
			if !d.settle() {
				d.report("give back", d.jm.Nak())
			}
		}
		d.release()
	}
}

// insertAfter links d into the hand after at, or first when at is nil. The caller holds mu.
func (h *hand) insertAfter(at, d *delivery) {
	d.held = true
	d.prev = at
	if at == nil {
		d.next = h.head
		h.head = d
	} else {
		d.next = at.next
		at.next = d
	}
	if d.next == nil {
		h.tail = d
	} else {
		d.next.prev = d
	}
}

// remove unlinks d from the hand. The caller holds mu.
func (h *hand) remove(d *delivery) {
	if d.prev == nil {
		h.head = d.next
	} else {
		d.prev.next = d.next
	}
	if d.next == nil {
		h.tail = d.prev
	} else {
		d.next.prev = d.prev
	}
	d.prev, d.next, d.held = nil, nil, false
}
