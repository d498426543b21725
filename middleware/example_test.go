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

// The canonical exactly-once chain, composed from its stages: each stage goes in its place,
// whatever order the program names them in. Here each stage only prints its name; a program
// gives the middlewares of the same names (Tracing, Metrics, DeadLetter, Recover, Retry,
// Transaction, Deduplicate) for the stages it wants.
func ExampleExactlyOnce() {
	chain, err := middleware.ExactlyOnce(middleware.Stages{
		Deduplicate: annotate("deduplicate"),
		Transaction: annotate("transaction"),
		Retry:       annotate("retry"),
		Recover:     annotate("recover"),
		DeadLetter:  annotate("deadletter"),
		Metrics:     annotate("metrics"),
		Tracing:     annotate("tracing"),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	audited := middleware.Chain(annotate("audit"), chain) // a middleware of one's own goes around it
	p := audited(processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		fmt.Println("processor", msg.ID)
		return nil
	}))

	_ = p.Process(context.Background(), &messagedata.MessageData{ID: "m-1"})
	// Output:
	// audit before
	// tracing before
	// metrics before
	// deadletter before
	// recover before
	// retry before
	// transaction before
	// deduplicate before
	// processor m-1
	// deduplicate after
	// transaction after
	// retry after
	// recover after
	// deadletter after
	// metrics after
	// tracing after
	// audit after
}
