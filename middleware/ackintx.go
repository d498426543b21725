package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// ErrNoTxAck reports a message whose subscriber cannot acknowledge it inside a transaction
// (its context carries no redelivery.TxAck): AckInTransaction needs the PostgreSQL or MySQL
// queue of the handler's own database.
var ErrNoTxAck = errors.New("the message's subscriber cannot acknowledge it in a transaction")

// AckInTransaction acknowledges the message inside the transaction, before calling next, for
// a queue that lives in the handler's database (the PostgreSQL and MySQL queues of package
// broker/sqlqueue): the acknowledgement commits with the processor's writes or rolls back with
// them. A message is then consumed exactly when its effect commits, with no dedup row at all;
// a redelivery can only follow a rollback.
//
// When the subscriber says the delivery is no longer its own (its lease passed and another
// consumer holds the message), nothing is processed and the error wraps
// processor.ErrDuplicate: the other consumer applies it. A message whose subscriber gives no
// redelivery.TxAck fails with ErrNoTxAck.
//
// It must run inside Transaction, in place of Deduplicate.
func AckInTransaction() Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, ok := CurrentTx(ctx)
			if !ok {
				return errOutsideTransaction
			}
			ack, ok := redelivery.TxAckFrom(ctx)
			if !ok {
				return ErrNoTxAck
			}
			owned, err := ack(ctx, tx)
			if err != nil {
				return err
			}
			if !owned {
				return fmt.Errorf("%w: the queue gave message %q to another consumer (its lease passed), which applies it", processor.ErrDuplicate, msg.ID)
			}
			return next.Process(ctx, msg)
		})
	}
}
