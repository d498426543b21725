// Package sqltx runs short units of work in one transaction: schema migrations and the small
// bookkeeping writes of the packages that own tables (dedup, ordering).
package sqltx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/sqldb"
)

// Run runs fn in a transaction of db and commits when fn returns nil. Any error of fn, or a
// panic, rolls the transaction back; a failed rollback is joined to the error.
func Run(ctx context.Context, db *sqldb.DB, fn func(*sqlx.Tx) error) (err error) {
	tx, err := db.BeginTxx(ctx, nil)
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
	return tx.Commit()
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
