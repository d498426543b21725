package middleware_test

import (
	"context"
	"fmt"

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
