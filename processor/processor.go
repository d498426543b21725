package processor

import (
	"context"

	"github.com/onceflow/onceflow/messagedata"
)

// Processor applies the effect of one message.
//
// Process runs inside the middlewares of its handler: for the exactly-once qualities of
// service, inside a database transaction that also records the message id, so that the
// effect is committed exactly once. The returned error decides what happens next (see the
// package documentation): nil commits and acks; ErrDuplicate rolls back and acks; an error
// made by Permanent rolls back and dead-letters; any other error rolls back and is retried,
// then nacked; a panic rolls back and nacks.
type Processor interface {
	Process(ctx context.Context, msg *messagedata.MessageData) error
}

// Func adapts an ordinary function to a Processor.
type Func func(ctx context.Context, msg *messagedata.MessageData) error

// Process calls f(ctx, msg).
func (f Func) Process(ctx context.Context, msg *messagedata.MessageData) error {
	return f(ctx, msg)
}
