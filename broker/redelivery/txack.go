package redelivery

import (
	"context"
	"database/sql"
)

// Execer runs a statement in the caller's database transaction: *sql.Tx and *sqlx.Tx are
// Execers.
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// TxAck acknowledges one delivery inside the caller's database transaction, for a queue that
// lives in the same database as the handler's data (the PostgreSQL and MySQL queues): the
// acknowledgement commits or rolls back with the business writes, so a message is consumed if
// and only if its effect is committed. It reports false when the delivery is no longer the
// subscriber's to acknowledge (its lease passed and another consumer holds the message, or it
// was acknowledged already): the caller must then roll back.
type TxAck func(ctx context.Context, tx Execer) (bool, error)

type txAckKey struct{}

// WithTxAck returns a context, for a message a subscriber hands out, that carries the
// message's TxAck.
func WithTxAck(ctx context.Context, ack TxAck) context.Context {
	return context.WithValue(ctx, txAckKey{}, ack)
}

// TxAckFrom returns the TxAck of a message's context, if its subscriber gave one.
func TxAckFrom(ctx context.Context) (TxAck, bool) {
	ack, ok := ctx.Value(txAckKey{}).(TxAck)
	return ack, ok && ack != nil
}
