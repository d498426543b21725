// Package sqltx runs units of work in one transaction, for every package of onceflow that
// opens its own: begin, run, roll back on error or panic with the rollback's error joined,
// commit.
package sqltx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/sqldb"
)

// Tx is a transaction: *sql.Tx and *sqlx.Tx are.
type Tx interface {
	Commit() error
	Rollback() error
}

// ErrCommitOutcomeUnknown reports that the connection failed while COMMIT was in flight, so the
// transaction may or may not have committed (middleware.ErrCommitOutcomeUnknown is this error).
var ErrCommitOutcomeUnknown = errors.New("commit outcome unknown")

// CommitFailed returns the error of a COMMIT that failed with err: one wrapping
// ErrCommitOutcomeUnknown when the connection was lost while it was in flight (it may have
// committed), or its context ended; otherwise err, saying it was the commit's. It is the one
// place a commit's failure is classified.
func CommitFailed(err error) error {
	if sqldb.Classify(err) == sqldb.Connection || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %w", ErrCommitOutcomeUnknown, err)
	}
	return fmt.Errorf("commit: %w", err)
}

// CommitError is the error of a COMMIT that failed, as Do returns it, so that a caller can
// tell it from an error of the work (errors.As): the connection may have been lost while
// COMMIT was in flight, and then the work may be in the database. Its message is Err's.
type CommitError struct{ Err error }

func (e *CommitError) Error() string { return e.Err.Error() }

// Unwrap returns the error of the COMMIT.
func (e *CommitError) Unwrap() error { return e.Err }

// Do runs fn in the transaction that begin starts and commits it when fn returns nil. Any
// error of fn, or a panic, rolls the transaction back; a failed rollback is joined to the
// error. The error of a failed COMMIT is a *CommitError: callers that must tell an unknown
// outcome apart classify it.
func Do[T Tx](ctx context.Context, begin func(context.Context) (T, error), fn func(T) error) (err error) {
	tx, err := begin(ctx)
	if err != nil {
		return err
	}
	committed := false
	defer func() {
		if committed {
			return
		}
		if rerr := tx.Rollback(); rerr != nil && !errors.Is(rerr, sql.ErrTxDone) {
			err = errors.Join(err, fmt.Errorf("roll back: %w", rerr))
		}
	}()
	if err := fn(tx); err != nil {
		return err
	}
	committed = true
	if err := tx.Commit(); err != nil {
		return &CommitError{Err: err}
	}
	return nil
}

// Run runs fn in a transaction of db, as Do.
func Run(ctx context.Context, db *sqldb.DB, fn func(*sqlx.Tx) error) error {
	return Do(ctx, func(ctx context.Context) (*sqlx.Tx, error) { return db.BeginTxx(ctx, nil) }, fn)
}

// RunSQL runs fn in a transaction of a database/sql handle, as Do.
func RunSQL(ctx context.Context, db *sql.DB, fn func(*sql.Tx) error) error {
	return Do(ctx, func(ctx context.Context) (*sql.Tx, error) { return db.BeginTx(ctx, nil) }, fn)
}

// Exec runs first (when not nil) and then stmts in one transaction on db, and commits. Any
// error rolls the transaction back; a failed rollback is joined to the error.
func Exec(ctx context.Context, db *sqldb.DB, stmts []string, first func(*sqlx.Tx) error) error {
	return Run(ctx, db, func(tx *sqlx.Tx) error {
		if first != nil {
			if err := first(tx); err != nil {
				return err
			}
		}
		for _, stmt := range stmts {
			if _, err := tx.ExecContext(ctx, stmt); err != nil {
				return err
			}
		}
		return nil
	})
}
