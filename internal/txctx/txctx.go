// Package txctx is the context key under which the handler's transaction and the internal id of
// a message travel: middleware writes them (middleware.WithTx, middleware.WithInternalID) and
// processor reads them (processor.TxFromContext, processor.InternalID), and neither package
// imports the other for it.
package txctx

import "context"

type txKey struct{}

// WithTx returns a context that carries tx.
func WithTx(ctx context.Context, tx any) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// Tx returns the transaction that ctx carries, nil when there is none.
func Tx(ctx context.Context) any { return ctx.Value(txKey{}) }

// IsTxKey reports whether k is the key under which WithTx puts the transaction: a context that
// holds a transaction itself answers Value(k) with it.
func IsTxKey(k any) bool {
	_, ok := k.(txKey)
	return ok
}

type internalIDKey struct{}

// WithInternalID returns a context that carries the internal id minted for the message.
func WithInternalID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, internalIDKey{}, id)
}

// InternalID returns the internal id that ctx carries, and whether there is one.
func InternalID(ctx context.Context) (string, bool) {
	id, ok := ctx.Value(internalIDKey{}).(string)
	return id, ok
}
