package middleware

import (
	"github.com/onceflow/onceflow/processor"
)

// Middleware wraps a Processor with behaviour of its own: it may act before and after calling
// next, change the context next sees, or not call next at all.
type Middleware func(next processor.Processor) processor.Processor

// Chain composes middlewares into one.
//
// Middlewares run in the order given: the first is the outermost, so it sees the message first
// and the outcome last. Chain(a, b, c)(p) processes a message as a(b(c(p))).
func Chain(outer Middleware, others ...Middleware) Middleware {
	return func(next processor.Processor) processor.Processor {
		for i := len(others) - 1; i >= 0; i-- {
			next = others[i](next)
		}
		return outer(next)
	}
}
