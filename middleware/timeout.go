package middleware

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// Timeout cancels the context of the chain inside it after d. Placed inside Retry it bounds
// each attempt; outside, the whole delivery. A transaction whose context ends is rolled back,
// so an attempt that times out commits nothing.
func Timeout(d time.Duration) Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			ctx, cancel := context.WithTimeout(ctx, d)
			defer cancel()
			return next.Process(ctx, msg)
		})
	}
}
