package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// PositionStore keeps a handler's position in each partition of an ordered log, in the
// business transaction; dedup.Positions is the SQL one.
type PositionStore interface {
	// Lock takes the position of handler in partition of topic in tx, and returns the offset
	// last applied there (-1 for none); the position stays locked until tx ends.
	Lock(ctx context.Context, tx sqlx.ExtContext, handler, topic string, partition int32) (int64, error)
	// Set records offset as the last applied, in tx, after Lock.
	Set(ctx context.Context, tx sqlx.ExtContext, handler, topic string, partition int32, offset int64) error
}

// PositionAdvancer is a PositionStore that can also take and record a position in one
// statement when the message is the partition's next (dedup.Positions is one): Offsets then
// needs one statement per message instead of two.
type PositionAdvancer interface {
	PositionStore
	// Advance records offset as the last applied in tx, and locks the position until tx ends,
	// if the offset recorded is below offset and at or above previous. It reports whether it
	// did; when it did not, nothing changed.
	Advance(ctx context.Context, tx sqlx.ExtContext, handler, topic string, partition int32, offset, previous int64) (bool, error)
}

// ErrPositionAhead reports a message whose predecessor in its partition is not applied yet
// (it is still being processed, or failed): it is retried, and comes after its predecessor.
var ErrPositionAhead = errors.New("the message before it in its partition is not applied yet")

// Offsets is duplicate detection by position, for brokers that deliver each partition of a
// topic in order (Kafka): inside the transaction, it locks the handler's position in the
// message's partition, and a message at or below the offset recorded there is a duplicate
// (an error wrapping processor.ErrDuplicate: the router acks); otherwise it calls next and
// records the message's offset, which commits with the processor's writes. No row is written
// per message, and a consumer that takes a partition over (after a crash or a rebalance)
// resumes after the recorded offset.
//
// The message's position comes from its headers (messagedata.PositionOf), written by the
// subscriber. A message without one is refused with a permanent error: its broker has no
// partitions. A message whose predecessor in the partition is not applied yet (the
// subscriber names the last message before it that is not acked) returns an error wrapping
// ErrPositionAhead, retryable, so that no offset is skipped when messages of one partition
// run at once. onceflow's router asks the subscriber for each partition's messages one at a
// time, in order (redelivery.WithPositions), so that this does not happen with its Kafka
// subscriber.
//
// It must run inside Transaction, in place of Deduplicate.
func Offsets(store PositionStore, handler string) Middleware {
	advancer, _ := store.(PositionAdvancer)
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			pos, err := positionOf(msg)
			if err != nil {
				return err
			}
			tx, ok := CurrentTx(ctx)
			if !ok {
				return errOutsideTransaction
			}
			dctx, end := telemetry.Child(ctx, telemetry.SpanDedup)
			if advancer != nil {
				// The common case, the partition's next message, in one statement; Lock tells
				// why it was not.
				advanced, err := advancer.Advance(dctx, tx, handler, msg.Topic, pos.Partition, pos.Offset, pos.Previous)
				if err == nil && advanced {
					end(nil)
					return next.Process(ctx, msg)
				}
				if err != nil {
					end(err)
					return invalidKeyIsPermanent(err)
				}
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
