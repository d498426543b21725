package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

func annotate(name string) middleware.Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			fmt.Println(name, "before")
			err := next.Process(ctx, msg)
			fmt.Println(name, "after")
			return err
		})
	}
}

// Middlewares run in the order given: the first is the outermost, so it sees the message first
// and the outcome last.
func ExampleChain() {
	chain := middleware.Chain(annotate("first"), annotate("second"), annotate("third"))
	p := chain(processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		fmt.Println("processor", msg.ID)
		return nil
	}))

	_ = p.Process(context.Background(), &messagedata.MessageData{ID: "m-1"})
	// Output:
	// first before
	// second before
	// third before
	// processor m-1
	// third after
	// second after
	// first after
}

// A built-in middleware is built from its configuration, whose zero fields take the defaults:
// here Retry runs the processor again after a retryable error, up to MaxAttempts times.
func ExampleRetry() {
	retry, err := middleware.Retry{MaxAttempts: 3, InitialInterval: time.Millisecond}.Middleware()
	if err != nil {
		fmt.Println(err)
		return
	}
	attempts := 0
	p := retry(processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		attempts++
		if attempts < 3 {
			return errors.New("database busy")
		}
		return nil
	}))
	err = p.Process(context.Background(), &messagedata.MessageData{ID: "m-1"})
	fmt.Println(attempts, err)

	_, err = middleware.Retry{MaxAttempts: -1}.Middleware()
	fmt.Println(err)
	// Output:
	// 3 <nil>
	// Retry.MaxAttempts: -1 is negative
}
