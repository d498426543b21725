package inflight

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// deliveryContext is the context of one delivery, kept in its Delivery so that the delivery
// and its context take one allocation: the subscription's base values, the delivery's
// redelivery.Values, and an end with a cause (cancel).
//
// It behaves as a context of context.WithCancelCause on base carrying the Values would, but
// makes that context (inner) only when something needs it: a Done channel (which a context
// derived with a cancel or AfterFunc asks for), or an end with a cause other than
// context.Canceled, which context.Cause can only find in a context of the context package.
// Until then, Err and Value need no more than the fields here, and context.Cause, finding no
// cancellable context above, returns Err.
type deliveryContext[T any] struct {
	base context.Context // the subscription's base: values, no deadline, never done
	d    *Delivery[T]
	vals redelivery.Values

	ended atomic.Bool // set once the delivery's context has ended
	inner atomic.Pointer[innerContext]
	mu    sync.Mutex // makes inner, and ends it, once
	cause error      // why it ended, under mu; nil for context.Canceled
}

// innerContext is the context of the context package that a deliveryContext makes on demand.
type innerContext struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// Deadline is base's: none.
func (c *deliveryContext[T]) Deadline() (time.Time, bool) { return c.base.Deadline() }

// Done returns a channel closed when the delivery's context ends.
func (c *deliveryContext[T]) Done() <-chan struct{} { return c.makeInner().ctx.Done() }

// Err returns context.Canceled once the delivery's context has ended. Once inner is made, it
// answers: end closes inner's Done before it sets ended, and a goroutine woken by Done must
// find Err set.
func (c *deliveryContext[T]) Err() error {
	if in := c.inner.Load(); in != nil {
		return in.ctx.Err()
	}
	if c.ended.Load() {
		return context.Canceled
	}
	return nil
}

// Value returns the delivery's redelivery values, and otherwise base's (through inner, once
// made: it answers for itself the key that context.Cause and the contexts derived from this
// one ask for).
func (c *deliveryContext[T]) Value(k any) any {
	if v, ok := c.vals.Value(k); ok {
		return v
	}
	if in := c.inner.Load(); in != nil {
		return in.ctx.Value(k)
	}
	return c.base.Value(k)
}

// Settled is the delivery's side of redelivery.Settle.
func (c *deliveryContext[T]) Settled() { c.d.sub.settle(c.d, redelivery.Acked(c.d.Msg)) }

// Flush is the delivery's side of redelivery.Flush.
func (c *deliveryContext[T]) Flush() { c.d.sub.flush() }

// makeInner returns inner, made (and ended, if the delivery's context has ended) if it was
// not yet.
func (c *deliveryContext[T]) makeInner() *innerContext {
	if in := c.inner.Load(); in != nil {
		return in
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if in := c.inner.Load(); in != nil {
		return in
	}
	in := &innerContext{}
	in.ctx, in.cancel = context.WithCancelCause(c.base)
	if c.ended.Load() {
		in.cancel(c.cause)
	}
	c.inner.Store(in)
	return in
}

// end ends the delivery's context with cause (nil: context.Canceled); only the first end
// counts. Once it has returned, Done is closed, Err reports the end and context.Cause finds
// cause.
func (c *deliveryContext[T]) end(cause error) {
	if cause == context.Canceled {
		cause = nil
	}
	if cause != nil {
		c.makeInner() // the cause lives in a context of the context package
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended.Load() {
		return
	}
	c.cause = cause
	if in := c.inner.Load(); in != nil {
		in.cancel(cause)
	}
	c.ended.Store(true)
}

// String names the context, as the context package names its own.
func (c *deliveryContext[T]) String() string { return "inflight.deliveryContext" }
