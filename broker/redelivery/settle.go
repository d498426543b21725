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
// Settler to run on Settle (NewDeliveryContext, Values) and reads the message's Acked channel
// from it. onceflow's router settles directly; any other consumer gets the watching subscriber.

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

// settleKey carries the settler of one message.
type settleKey struct{}

// settler runs a message's Settler: Settled once, Flush on each Flush.
type settler struct {
	to   Settler
	done atomic.Bool
}

// Settler is a subscriber's side of Settle and Flush for one delivered message (Values.Init).
type Settler interface {
	// Settled runs once, on the message's first Settle, in the goroutine of the consumer
	// that acked or nacked it; it tells the two apart with Acked.
	Settled()
	// Flush runs on each Flush of the message, in the consumer's goroutine.
	Flush()
}

// NewDeliveryContext returns a copy of ctx, the context of one delivered message, that carries
// info, as NewContext does, and in which Settle runs settled once, in the goroutine of the
// consumer that calls it after it acked or nacked the message, and Flush runs flush, in the
// goroutine of the consumer that calls it (nil for nothing, either). It takes one allocation: a
// subscriber whose deliveries' contexts are a type of its own keeps Values in it instead.
func NewDeliveryContext(ctx context.Context, info Info, settled, flush func()) context.Context {
	c := &deliveryContext{Context: ctx, settled: settled, flush: flush}
	c.v.Init(info, c)
	return c
}

// deliveryContext carries the Values of NewDeliveryContext, and is their Settler.
type deliveryContext struct {
	context.Context
	v              Values
	settled, flush func()
}

func (c *deliveryContext) Value(k any) any {
	if v, ok := c.v.Value(k); ok {
		return v
	}
	return c.Context.Value(k)
}

func (c *deliveryContext) Settled() {
	if c.settled != nil {
		c.settled()
	}
}

func (c *deliveryContext) Flush() {
	if c.flush != nil {
		c.flush()
	}
}

// Values are what the context of one delivered message carries for this package, as
// NewDeliveryContext makes it: the message's Info, the delay NackAfter asked for, and what
// Settle and Flush run. A subscriber whose deliveries' contexts are a type of its own keeps
// Values in it, so that each message's context takes one allocation: it calls Init once,
// before it hands the message out, and its context's Value method answers with Value first.
// The zero Values carry nothing.
type Values struct {
	st  state
	s   settler
	set bool
}

// Init makes v carry info, and, when s is not nil, makes Settle and Flush of the message run
// s.Settled (once) and s.Flush. Without s, Settle and Flush do nothing: the subscriber
// watches the message's Acked and Nacked channels itself.
func (v *Values) Init(info Info, s Settler) {
	v.st.info = info
	v.s.to = s
	v.set = true
}

// Value returns what a message's context carrying v holds under k, and reports whether k is
// one of this package's keys that v answers.
func (v *Values) Value(k any) (any, bool) {
	switch k.(type) {
	case key:
		if v.set {
			return &v.st, true
		}
	case settleKey:
		if v.set && v.s.to != nil {
			return &v.s, true
		}
	}
	return nil, false
}

// Settle tells the subscriber of msg that the consumer has acked or nacked it, when the
// subscriber asked to be told (a Settler): its Settled runs now, once; later calls do
// nothing. A consumer calls it after Ack, Nack or NackAfter, from the goroutine that settled
// the message; for a message whose subscriber did not ask it does nothing.
func Settle(msg *message.Message) {
	s, ok := msg.Context().Value(settleKey{}).(*settler)
	if ok && s.done.CompareAndSwap(false, true) {
		s.to.Settled()
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
// is free now (Settler.Flush). onceflow's router calls it after the last
// acknowledgement of a group that committed in one transaction, so that the next groups fill.
// For any other message it does nothing.
func Flush(msg *message.Message) {
	if s, ok := msg.Context().Value(settleKey{}).(*settler); ok {
		s.to.Flush()
	}
}
