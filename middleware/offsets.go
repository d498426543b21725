package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/dedup"

	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// ErrPositionAhead reports a message whose predecessor in its partition is not applied yet
// (it is still being processed, or failed): it is retried, and comes after its predecessor.
var ErrPositionAhead = errors.New("the message before it in its partition is not applied yet")

// offsets is duplicate detection by position (DedupByOffset) in store, for handler: inside the
// transaction, it locks the handler's position in the message's partition, and a message at or
// below the offset recorded there is a duplicate; otherwise it calls next and records the
// message's offset, which commits with the processor's writes. A consumer that takes a
// partition over (after a crash or a rebalance) resumes after the recorded offset. onceflow's
// router asks the subscriber for each partition's messages one at a time, in order
// (redelivery.WithPositions), so that ErrPositionAhead does not happen with its Kafka
// subscriber.
func offsets(store *dedup.Positions, handler string) Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			pos, err := dedup.PositionOf(msg)
			if err != nil {
				return err
			}
			tx, ok := CurrentTx(ctx)
			if !ok {
				return errOutsideTransaction
			}
			dctx, end := telemetry.Child(ctx, telemetry.SpanDedup)
			// The common case, the partition's next message, in one statement; Lock tells why it
			// was not.
			advanced, err := store.Advance(dctx, tx, handler, msg.Topic, pos.Partition, pos.Offset, pos.Previous)
			if err == nil && advanced {
				end(nil)
				return next.Process(ctx, msg)
			}
			if err != nil {
				end(err)
				return invalidKeyIsPermanent(err)
			}
			applied, err := store.Lock(dctx, tx, handler, msg.Topic, pos.Partition)
			end(err)
			switch {
			case err != nil:
				return invalidKeyIsPermanent(err)
			case pos.Offset <= applied:
				return fmt.Errorf("%w: offset %d of partition %d is at or below the last applied, %d", processor.ErrDuplicate, pos.Offset, pos.Partition, applied)
			case pos.Previous > applied:
				return fmt.Errorf("%w: offset %d of partition %d follows %d, and the last applied is %d", ErrPositionAhead, pos.Offset, pos.Partition, pos.Previous, applied)
			}
			if err := next.Process(ctx, msg); err != nil {
				return err
			}
			return store.Set(ctx, tx, handler, msg.Topic, pos.Partition, pos.Offset)
		})
	}
}
