package middleware

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/txctx"
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

// Beginner begins the transactions that Transaction and group commit run the chain in. Pool
// makes one of a database; tests and benchmarks may pass stand-ins.
type Beginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (Tx, error)
}

// TxxBeginner is a connection pool that begins sqlx transactions: *sqldb.DB and *sqlx.DB are.
type TxxBeginner interface {
	BeginTxx(ctx context.Context, opts *sql.TxOptions) (*sqlx.Tx, error)
}

// Pool returns the Beginner of db's transactions. Each is an *sqlx.Tx, which
// processor.TxFromContext returns to the processor.
func Pool(db TxxBeginner) Beginner { return pool{db} }

type pool struct{ db TxxBeginner }

func (p pool) BeginTx(ctx context.Context, opts *sql.TxOptions) (Tx, error) {
	tx, err := p.db.BeginTxx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return tx, nil
}

// WithTx returns a context that carries tx. Transaction and group commit put the transaction
// they open in the context likewise (under the router, in the delivery's own context, which
// answers for it the same way); a transaction middleware of one's own calls WithTx. Middlewares
// further in read the transaction with CurrentTx, processors with processor.TxFromContext
// (which returns it when it is an *sqlx.Tx).
func WithTx(ctx context.Context, tx Tx) context.Context { return txctx.WithTx(ctx, tx) }

// CurrentTx returns the transaction in ctx, of whatever type the transaction middleware
// opened, and whether there is one.
func CurrentTx(ctx context.Context) (Tx, bool) {
	tx, ok := txctx.Tx(ctx).(Tx)
	return tx, ok
}

// WithInternalID returns a context that carries the internal id minted for the message, which
// processor.InternalID returns. DedupCheckFirst calls it.
func WithInternalID(ctx context.Context, id string) context.Context {
	return txctx.WithInternalID(ctx, id)
}
