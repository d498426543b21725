package redelivery

import (
	"context"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
)

// A subscriber must learn when each message it handed out is acked or nacked. watermill's
// Message tells only through its Acked and Nacked channels, and waiting on them costs the
// subscriber a goroutine (or a timer and a select) per message. A consumer that tells the
// subscriber itself, by calling Settle right after every Ack, Nack or NackAfter of every
// message it receives, says so on the context it subscribes with (WithDirectSettle). A
// subscriber that sees it there (SettlesDirectly) may skip the wait: it gives each message a
// function to run on Settle (NewSettleContext) and reads the message's Acked channel from it.
// onceflow's router settles directly; any other consumer gets the watching subscriber.

type directSettleKey struct{}

// WithDirectSettle returns a copy of ctx, the context of a Subscribe call, that promises the
// subscriber a call of Settle after the Ack or Nack of every message delivered on the
// subscription, including the messages the consumer nacks unprocessed because it is closing.
func WithDirectSettle(ctx context.Context) context.Context {
	return context.WithValue(ctx, directSettleKey{}, true)
}

// SettlesDirectly reports whether the consumer that subscribed with ctx calls Settle for every
// message (WithDirectSettle).
func SettlesDirectly(ctx context.Context) bool {
	v, _ := ctx.Value(directSettleKey{}).(bool)
	return v
}

// settleKey carries the settle function of one message.
type settleKey struct{}

// settler runs a message's settle function once, and its flush function on Flush.
type settler struct {
	f     func()
	flush func()
	done  atomic.Bool
}

// NewSettleContext returns a copy of ctx, the context of one delivered message, in which
// Settle runs settled once, in the goroutine of the consumer that calls it, after the consumer
// acked or nacked the message. settled tells the two apart with Acked.
func NewSettleContext(ctx context.Context, settled func()) context.Context {
	return context.WithValue(ctx, settleKey{}, &settler{f: settled})
}

// NewSettleFlushContext is NewSettleContext for a subscriber that acts on several settlements
// together: it holds acknowledgements back to send several at once, or waits for more free
// room before it asks the broker for more messages. In the returned context Flush runs flush,
// in the goroutine of the consumer that calls it, which then sends the acknowledgements it
// holds that may go now, and asks for the room that is free.
func NewSettleFlushContext(ctx context.Context, settled, flush func()) context.Context {
	return context.WithValue(ctx, settleKey{}, &settler{f: settled, flush: flush})
}

// NewDeliveryContext returns a copy of ctx, the context of one delivered message, that carries
// info, as NewContext does, and in which Settle runs settled and Flush runs flush, as in
// NewSettleFlushContext (flush may be nil). It is the three in one value: a subscriber that
// hands out many messages allocates it once for each, where the separate calls allocate four
// times.
func NewDeliveryContext(ctx context.Context, info Info, settled, flush func()) context.Context {
	return &deliveryContext{Context: ctx, st: state{info: info}, s: settler{f: settled, flush: flush}}
}

// deliveryContext carries the state of NewContext and the settler of NewSettleFlushContext.
type deliveryContext struct {
	context.Context
	st state
	s  settler
}

func (c *deliveryContext) Value(k any) any {
	switch k.(type) {
	case key:
		return &c.st
	case settleKey:
		return &c.s
	}
	return c.Context.Value(k)
}

// Settle tells the subscriber of msg that the consumer has acked or nacked it, when the
// subscriber asked to be told (NewSettleContext): its function runs now, once; later calls do
// nothing. A consumer calls it after Ack, Nack or NackAfter, from the goroutine that settled
// the message; for a message whose subscriber did not ask it does nothing.
func Settle(msg *message.Message) {
	s, ok := msg.Context().Value(settleKey{}).(*settler)
	if ok && s.done.CompareAndSwap(false, true) {
		s.f()
	}
}

// Acked reports whether msg, settled already, was acked: its Acked channel is closed.
func Acked(msg *message.Message) bool {
	select {
	case <-msg.Acked():
		return true
	default:
		return false
	}
}

// Flush tells the subscriber of msg, which the consumer has settled (Settle) as the last of
// several that it settled together, that no more come at once: the consumer waits for new
// messages before it settles others. A subscriber that holds acknowledgements back to send
// them together sends what may go now instead of waiting for more, and one that waits for
// more free room in its window before it asks the broker for messages asks for the room that
// is free now (NewSettleFlushContext). onceflow's router calls it after the last
// acknowledgement of a group that committed in one transaction, so that the next groups fill.
// For any other message it does nothing.
func Flush(msg *message.Message) {
	if s, ok := msg.Context().Value(settleKey{}).(*settler); ok && s.flush != nil {
		s.flush()
	}
}
