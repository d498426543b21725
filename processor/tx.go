package processor

import (
	"context"
	"errors"

	"github.com/jmoiron/sqlx"
)

// ErrNoTransaction reports a call that needs the handler's transaction made with a context
// that carries none: a middleware placed outside Transaction, or an outbox publish made
// outside the handler's chain. The errors wrapping it say which.
var ErrNoTransaction = errors.New("no transaction in the context")

// Tx is a database transaction as the middlewares see it. *sqlx.Tx satisfies it; tests and
// benchmarks may pass stand-ins.
type Tx interface {
	sqlx.ExtContext
	Commit() error
	Rollback() error
}

type txKey struct{}

// WithTx returns a context that carries tx. The Transaction middleware calls it after opening
// the transaction; middlewares and processors further in read it with TxFromContext.
func WithTx(ctx context.Context, tx Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// CurrentTx returns the transaction in ctx, of whatever type the Transaction middleware
// opened, and whether there is one. Middlewares use it; processors use TxFromContext.
func CurrentTx(ctx context.Context) (Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(Tx)
	return tx, ok
}

// TxFromContext returns the database transaction that the Transaction middleware opened for
// this message, and whether there is one.
//
// Who owns it: the Transaction middleware begins it before the next middleware runs, commits
// it when the chain inside returns nil, and rolls it back on any error or panic. The message is
// acknowledged only after the commit. A processor writes through it and must not call Commit
// or Rollback. Every write made through it, including the duplicate-detection row and outbox
// messages, commits or rolls back together.
func TxFromContext(ctx context.Context) (*sqlx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(*sqlx.Tx)
	return tx, ok
}

type internalIDKey struct{}

// WithInternalID returns a context that carries the internal id minted for the message. The
// check-first mode of the Deduplicate middleware calls it.
func WithInternalID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, internalIDKey{}, id)
}

// InternalID returns the internal, time-ordered id that the check-first mode of the
// Deduplicate middleware minted for the message (the id mapping), and whether there is
// one. The mapping from the external message id to this id commits with the processor's
// writes.
func InternalID(ctx context.Context) (string, bool) {
	id, ok := ctx.Value(internalIDKey{}).(string)
	return id, ok
}
