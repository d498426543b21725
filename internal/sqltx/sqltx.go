// Package sqltx runs a short sequence of statements in one transaction: the schema migrations
// of the packages that own tables (dedup, ordering).
package sqltx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/sqldb"
)

// Exec runs first (when not nil) and then stmts in one transaction on db, and commits. Any
// error rolls the transaction back; a failed rollback is joined to the error.
func Exec(ctx context.Context, db *sqldb.DB, stmts []string, first func(*sqlx.Tx) error) (err error) {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			if rerr := tx.Rollback(); rerr != nil && !errors.Is(rerr, sql.ErrTxDone) {
				err = errors.Join(err, fmt.Errorf("roll back: %w", rerr))
			}
		}
	}()
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
	return tx.Commit()
}
