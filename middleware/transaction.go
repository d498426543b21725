package middleware

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/internal/crashpoint"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// ErrCommitOutcomeUnknown reports that the connection failed while COMMIT was in flight, so the
// transaction may or may not have committed. The message is not acknowledged: it is retried or
// redelivered, and duplicate detection absorbs the second copy if the commit did happen.
var ErrCommitOutcomeUnknown = sqltx.ErrCommitOutcomeUnknown

// ErrGroupAborted reports a member of a group whose own processing succeeded, or never ran,
// but whose group's transaction was rolled back: a statement of the group itself failed (BEGIN,
// the id insert, a savepoint, the connection was lost, ...). Nothing of the member was
// committed; the error is retryable.
var ErrGroupAborted = errors.New("group transaction rolled back")

// Transaction configures the transaction stage: it runs the stages inside it in a database
// transaction. The zero value is the default configuration.
//
// It begins the transaction, puts it in the context (processor.TxFromContext reads it), and
// calls next. When next returns nil it commits; when next returns an error or panics it rolls
// back, and returns the error or re-panics. Nothing inside may commit or roll back the
// transaction. A commit that fails because the connection was lost, or because ctx ended while
// it was in flight, returns an error wrapping ErrCommitOutcomeUnknown; every other commit
// failure means nothing was committed. Either way the message is not acknowledged. Under the
// router with group commit (onceflow.Handler.GroupCommit), the transaction stage runs one
// transaction per group instead, with the same Isolation.
type Transaction struct {
	// Isolation is the isolation level of the transaction. Defaults to the database's default
	// level (PostgreSQL's duplicate detection expects READ COMMITTED).
	Isolation sql.IsolationLevel
}

// Middleware returns the transaction stage of t, whose transactions db begins.
//
// It is not inlined: inlined into its caller, the closures of each message's transaction
// escape to the heap there, three allocations per message (BenchmarkCanonicalChain).
//
//go:noinline
func (t Transaction) Middleware(db Beginner) Middleware {
	var optsPtr *sql.TxOptions
	if t.Isolation != 0 {
		optsPtr = &sql.TxOptions{Isolation: t.Isolation}
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
				txCtx, st := delivery.WithTx(ctx, tx) // as WithTx, with no allocation under the router
				defer st.EndTx()
				if err := next.Process(txCtx, msg); err != nil {
					return err
				}
				crashpoint.Reach(crashpoint.BeforeCommit, msg.ID)
				_, end = telemetry.Child(ctx, telemetry.SpanCommit)
				return nil
			})
			if end == nil { // begin failed, or the chain inside: rolled back
				return err
			}
			if ce, ok := err.(*sqltx.CommitError); ok {
				end(ce.Err)
				return sqltx.CommitFailed(ce.Err)
			}
			end(nil)
			delivery.MarkCommitted(ctx, time.Now())
			return nil
		})
	}
}
