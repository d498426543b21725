package middleware

import (
	"context"
	"runtime/debug"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// Recover turns a panic inside the chain into an error of type *processor.PanicError carrying
// the panic value and stack; a panic whose value is a *processor.PanicError already (group commit
// re-raises a member's panic so) is returned as it is. The transaction, further in,
// has already rolled back by the time the panic reaches Recover. The router nacks the message,
// so nothing is committed and nothing is lost.
func Recover() Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) (err error) {
			defer func() {
				r := recover()
				if r == nil {
					return
				}
				if pe, ok := r.(*processor.PanicError); ok {
					// Re-raised by group commit in this goroutine: it carries the stack of the
					// panic in the group's goroutine.
					err = pe
					return
				}
				err = &processor.PanicError{Value: r, Stack: debug.Stack()}
			}()
			return next.Process(ctx, msg)
		})
	}
}
