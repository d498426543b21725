package middleware

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// ErrCommitOutcomeUnknown reports that the connection failed while COMMIT was in flight, so the
// transaction may or may not have committed. The message is not acknowledged: it is retried or
// redelivered, and duplicate detection absorbs the second copy if the commit did happen.
var ErrCommitOutcomeUnknown = errors.New("commit outcome unknown")

// TxOption configures Transaction, and the transaction of GroupCommit and GroupTransaction.
type TxOption interface {
	applyTx(*sql.TxOptions)
	GroupOption
}

type txOptionFunc func(*sql.TxOptions)

func (f txOptionFunc) applyTx(o *sql.TxOptions)  { f(o) }
func (f txOptionFunc) applyGroup(c *groupConfig) { f(&c.txOpts) }

// WithIsolation sets the isolation level of the transaction. Defaults to the database's own
// default level.
func WithIsolation(level sql.IsolationLevel) TxOption {
	return txOptionFunc(func(o *sql.TxOptions) { o.Isolation = level })
}

// Transaction runs the rest of the chain in a database transaction from db.
//
// It begins the transaction, puts it in the context (processor.TxFromContext reads it), and
// calls next. When next returns nil it commits; when next returns an error or panics it rolls
// back, and returns the error or re-panics. Nothing inside may commit or roll back the
// transaction. A commit that fails because the connection was lost, or because ctx ended while
// it was in flight, returns an error wrapping ErrCommitOutcomeUnknown; every other commit
// failure means nothing was committed. Either way
// the message is not acknowledged.
func Transaction(db Beginner, opts ...TxOption) Middleware {
	var txOpts sql.TxOptions
	for _, o := range opts {
		o.applyTx(&txOpts)
	}
	optsPtr := &txOpts
	if txOpts == (sql.TxOptions{}) {
		optsPtr = nil
	}
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			var end func(error)
			err := sqltx.Do(ctx, func(ctx context.Context) (Tx, error) {
				tx, err := db.BeginTx(ctx, optsPtr)
				if err != nil {
					return nil, fmt.Errorf("begin transaction: %w", err)
				}
				return tx, nil
			}, func(tx Tx) error {
				if err := next.Process(WithTx(ctx, tx), msg); err != nil {
					return err
				}
				_, end = telemetry.Child(ctx, telemetry.SpanCommit)
				return nil
			})
			if end == nil { // begin failed, or the chain inside: rolled back
				return err
			}
			if ce, ok := err.(*sqltx.CommitError); ok {
				end(ce.Err)
				return commitError(ce.Err)
			}
			end(nil)
			delivery.MarkCommitted(ctx, time.Now())
			return nil
		})
	}
}
