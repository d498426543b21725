package processor

import (
	"context"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/txctx"
)

// TxFromContext returns the database transaction that the Transaction middleware opened for
// this message, and whether there is one.
//
// Who owns it: the Transaction middleware begins it before the next middleware runs, commits
// it when the chain inside returns nil, and rolls it back on any error or panic. The message is
// acknowledged only after the commit. A processor writes through it and must not call Commit
// or Rollback. Every write made through it, including the duplicate-detection row and outbox
// messages, commits or rolls back together.
func TxFromContext(ctx context.Context) (*sqlx.Tx, bool) {
	tx, ok := txctx.Tx(ctx).(*sqlx.Tx)
	return tx, ok
}

// InternalID returns the internal, time-ordered id that the check-first mode of the
// Deduplicate middleware minted for the message (the id mapping), and whether there is
// one. The mapping from the external message id to this id commits with the processor's
// writes.
func InternalID(ctx context.Context) (string, bool) { return txctx.InternalID(ctx) }
