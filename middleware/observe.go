package middleware

import (
	"context"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// Observer watches deliveries from outside the rest of a chain without taking part in them: it
// changes neither the message nor the outcome. Tracing and Metrics are observers
// (Tracing.Observer, Metrics.Observer); Observe makes any observer a middleware.
//
// A consumer that runs the rest of the chain itself may call an observer directly: the router
// does so for a handler whose chain starts with observers and goes on with interceptors that
// leave a successful first delivery alone, and that hands its messages to group commit without
// a goroutine each.
type Observer interface {
	// Begin is called before the rest of the chain runs msg. The context it returns is the one
	// the rest of the chain runs with.
	Begin(ctx context.Context, msg *messagedata.MessageData) context.Context
	// End is called once the rest of the chain has returned err for msg, with the context
	// Begin returned.
	End(ctx context.Context, msg *messagedata.MessageData, err error)
}

// Observe returns the middleware of o: Begin, the rest of the chain, End.
func Observe(o Observer) Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			ctx = o.Begin(ctx, msg)
			err := next.Process(ctx, msg)
			o.End(ctx, msg, err)
			return err
		})
	}
}
