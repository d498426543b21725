// Package redelivery is what a subscriber tells onceflow's router about each message it
// delivers, and how the router asks for a message that failed to come back later.
//
// A subscriber puts an Info in the context of every message it hands out (NewContext): how
// many times the broker has delivered the message, and whether the subscriber can delay the
// redelivery of a nacked message. The router reads it (FromContext) to dead-letter a message
// at its handler's delivery limit. A message whose context carries no Info has an unknown
// count; the router then keeps the count itself, durably, in the handler's database.
//
// When a message fails, the router calls NackAfter with a delay that grows with the delivery
// count. A subscriber whose messages say DelaysNacks delivers the message again no sooner than
// that, by the broker's own means (a visibility time, a delayed negative acknowledgement);
// for the others NackAfter reports false, and the router holds the message for the delay
// before it nacks it.
//
// A consumer that detects duplicates by position gives its applied offsets to the subscriber
// on the Subscribe context (WithPositions, positions.go), and a consumer that settles each
// message itself says so there too (WithDirectSettle, settle.go), as does one that can take
// more deliveries at once than a subscriber's default prefetch (WithWindow, window.go).
//
// The package imports no broker client: custom subscribers can take part.
package redelivery

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Info is what a subscriber knows of one delivery of a message.
type Info struct {
	// Count is how many times the broker has delivered the message, this delivery included:
	// 1 for a first delivery. 0 when the broker does not count deliveries; Redelivered then
	// says whether this is the first.
	Count int

	// Redelivered reports, when Count is 0, that the broker delivered the message before
	// (RabbitMQ's redelivered flag on a classic queue). A subscriber that sets an Info with
	// Count 0 must set Redelivered truthfully: false means a first delivery.
	Redelivered bool

	// DelaysNacks reports that the subscriber honours the delay of NackAfter.
	DelaysNacks bool
}

// First reports whether the delivery is the message's first, as far as the broker knows.
func (i Info) First() bool {
	if i.Count > 0 {
		return i.Count == 1
	}
	return !i.Redelivered
}

// state is the value a delivered message's context carries.
type state struct {
	info Info
	// delay is the requested delay plus one nanosecond, so that a request for no delay is told
	// apart from no request; 0 until NackAfter runs.
	delay atomic.Int64
}

type key struct{}

// NewContext returns a copy of ctx that carries info, for the context of one delivered
// message.
func NewContext(ctx context.Context, info Info) context.Context {
	return context.WithValue(ctx, key{}, &state{info: info})
}

// FromContext returns the Info in ctx, and whether there is one.
func FromContext(ctx context.Context) (Info, bool) {
	st, ok := ctx.Value(key{}).(*state)
	if !ok {
		return Info{}, false
	}
	return st.info, true
}

// NackAfter nacks msg so that its subscriber delivers it again no sooner than d from now, and
// reports true, when the subscriber can delay redelivery (Info.DelaysNacks). Otherwise it does
// nothing and reports false: the caller holds the message for d and then nacks it.
func NackAfter(msg *message.Message, d time.Duration) bool {
	st, ok := msg.Context().Value(key{}).(*state)
	if !ok || !st.info.DelaysNacks {
		return false
	}
	st.delay.Store(int64(max(d, 0)) + 1)
	msg.Nack()
	return true
}

// RequestedDelay returns the delay that NackAfter asked for the message whose context is ctx,
// and whether it asked. A subscriber reads it when the message is nacked; without a request it
// applies its own nack delay.
func RequestedDelay(ctx context.Context) (time.Duration, bool) {
	st, ok := ctx.Value(key{}).(*state)
	if !ok {
		return 0, false
	}
	d := st.delay.Load()
	if d == 0 {
		return 0, false
	}
	return time.Duration(d - 1), true
}
