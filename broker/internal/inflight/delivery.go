package inflight

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// Item is a message that a source has taken from its broker, as it gives it to Emit.
type Item[T any] struct {
	// Data is what the source keeps of the message to settle it (a tag, an entry id, the
	// broker's own message); the delivery carries it back to Source.Settle.
	Data T
	// Msg is the message to hand out; Emit sets its context.
	Msg *message.Message
	// Count and Redelivered are the broker's delivery count (redelivery.Info).
	Count       int
	Redelivered bool
	// Kept says that the message takes one of the places its source kept (Subscription.Keep)
	// rather than one of the fetch in progress.
	Kept bool
	// Deadline is when the delivery ends unsettled (Options.ErrExpired): when the broker
	// gives the message to another consumer. Zero: Options.AckTimeout after the hand-out, or
	// never when that is zero.
	Deadline time.Time
}

// Outcome is how a delivery ended, as Source.Settle learns it.
type Outcome struct {
	// Acked and Nacked say what the consumer did before the delivery ended: acked, nacked,
	// or (both false) neither.
	Acked, Nacked bool
	// Delay is, for a nack, how long the broker is to wait before it delivers the message
	// again: the delay the consumer asked for (redelivery.NackAfter) or Options.NackDelay,
	// less what the engine has held it already (Options.HoldNacks).
	Delay time.Duration
	// Cause is nil when the consumer settled the delivery. Otherwise the delivery ended
	// first, and Cause says why: Options.ErrExpired (its deadline passed), the cause the
	// subscription stopped with (the Group's ErrClosed when it closed, the cause of the
	// Subscribe context when it ended), or the cause a source gave to End (a lost
	// connection).
	Cause error
	// Late is set for an ack that the consumer gave after the delivery had ended, which the
	// engine reports when Options.LateAcks is set.
	Late bool
	// HandedOut is when the consumer took the delivery; zero if it never did.
	HandedOut time.Time
	// Held is set, with Options.HoldNacks, for a nack whose hold begins (Delay is the whole
	// of it): the delivery has left the window and its context has ended, and the source
	// learns how it ends when the hold does, by a second Settle (Delay 0; or, when the
	// subscription ends first, the delay left and a Cause). A source whose books count the
	// deliveries in flight takes it out of them here.
	Held bool
}

// state is where a delivery stands; the subscription's mutex guards it.
type state uint8

const (
	// queued: emitted, waiting for its hand-out; it holds a place of the window.
	queued state = iota
	// out: handed out, not settled; it holds a place of the window.
	out
	// held: nacked, its nack held for its delay (Options.HoldNacks).
	held
	// ended: settled or ended, told to the source.
	ended
)

// Delivery is one message handed out (or about to be), from Emit until the source learns how
// it ended (Source.Settle). The engine allocates it; the source reads Data and Msg, and keeps
// the pointer for End.
type Delivery[T any] struct {
	Data T
	Msg  *message.Message

	sub *Subscription[T]
	// ctx is the context of the message (the one Emit gives it, unless a Contexter's values
	// wrap it).
	ctx deliveryContext[T]
	// Under sub.mu: its state, whether the consumer has taken it, and when while it was
	// queued or out (takenAt is not written after the delivery ends), its place in the list
	// of the deliveries in flight (prev, next), ordered by deadline, and, held, when its nack
	// is due and its place in the heap of holds.
	state      state
	handed     bool
	takenAt    time.Time
	deadline   time.Time
	prev, next *Delivery[T]
	due        time.Time
	index      int
}

// HandedOut reports whether the consumer had taken the delivery. Source.Settle reads it for a
// delivery given back at the end of the subscription: one never handed out may not count as
// delivered.
func (d *Delivery[T]) HandedOut() bool {
	d.sub.mu.Lock()
	defer d.sub.mu.Unlock()
	return d.handed
}

// given returns what the consumer has done with the delivery so far, without waiting.
func (d *Delivery[T]) given() (acked, nacked bool) {
	select {
	case <-d.Msg.Acked():
		return true, false
	default:
	}
	select {
	case <-d.Msg.Nacked():
		return false, true
	default:
	}
	return false, false
}

// nackDelay returns the delay of the delivery's nack: the one the consumer asked for, or the
// default.
func (d *Delivery[T]) nackDelay() time.Duration {
	if delay, ok := redelivery.RequestedDelay(d.Msg.Context()); ok {
		return delay
	}
	return d.sub.opt.NackDelay
}

// after reports whether deadline a comes after b, a zero deadline coming after every other.
func after(a, b time.Time) bool {
	switch {
	case a.IsZero():
		return !b.IsZero()
	case b.IsZero():
		return false
	}
	return a.After(b)
}

// holds is a min-heap of held deliveries by due time (container/heap).
type holds[T any] []*Delivery[T]

func (h holds[T]) Len() int           { return len(h) }
func (h holds[T]) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h holds[T]) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *holds[T]) Push(x any) {
	d := x.(*Delivery[T])
	d.index = len(*h)
	*h = append(*h, d)
}
func (h *holds[T]) Pop() any {
	old := *h
	d := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	d.index = -1
	return d
}
