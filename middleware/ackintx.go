package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// errNoTxAck reports a message whose subscriber cannot acknowledge it inside a transaction (its
// context carries no redelivery.TxAck): DedupAckInTransaction needs the PostgreSQL or MySQL
// queue of the handler's own database.
var errNoTxAck = errors.New("the message's subscriber cannot acknowledge it in a transaction (DedupAckInTransaction needs the PostgreSQL or MySQL queue of the handler's database)")

// ackInTransaction acknowledges the message inside the transaction, before calling next
// (DedupAckInTransaction). A message whose subscriber gives no redelivery.TxAck fails with
// errNoTxAck.
func ackInTransaction() Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, ok := CurrentTx(ctx)
			if !ok {
				return errOutsideTransaction
			}
			ack, ok := redelivery.TxAckFrom(ctx)
			if !ok {
				return errNoTxAck
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
