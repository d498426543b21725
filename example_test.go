package onceflow_test

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// A stage of one's own goes into the canonical chain with one line, by its position relative to
// a built-in stage; every stage not edited stays the library's. Here a tenant check runs once per
// delivery, outside the retry, and sees the final outcome. The handler takes the chain in
// Handler.Chain, and its QoS from it.
func ExampleChain() {
	tenant := func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if msg.Header("tenant") == "" {
				return processor.Permanent(fmt.Errorf("message %s names no tenant", msg.ID))
			}
			return next.Process(ctx, msg)
		})
	}
	chain := onceflow.ExactlyOnce.Chain().Before(onceflow.StageRetry, onceflow.Use("tenant", tenant))
	fmt.Println(chain)
	// Output:
	// tracing -> metrics -> deadletter -> recover -> tenant -> retry -> timeout -> transaction -> deduplicate
}

// Removing a stage that the quality of service promises is refused unless the chain says what
// it gives up.
func ExampleChain_Remove() {
	chain := onceflow.AtLeastOnce.Chain().Remove(onceflow.StageDeadLetter)
	fmt.Println(chain.Err())

	chain = onceflow.AtLeastOnce.Chain().Remove(onceflow.StageDeadLetter, onceflow.RedeliveredForever)
	fmt.Println(chain)
	// Output:
	// Remove(deadletter): AtLeastOnce promises that a message that cannot succeed is dead-lettered; pass onceflow.RedeliveredForever to give that up
	// tracing -> metrics -> recover -> retry -> timeout -> transaction
}
