package dbqueue

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/onceflow/onceflow/internal/sqltx"
)

// Beginner is a pool (*sql.DB) or one connection of it (*sql.Conn).
type Beginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// InTx runs fn in a transaction of db begun with opts (nil: the driver's defaults), committing
// when fn returns nil and rolling back otherwise, or on a panic; a failed rollback is joined to
// fn's error. The error of a failed BEGIN or COMMIT says which.
func InTx(ctx context.Context, db Beginner, opts *sql.TxOptions, fn func(tx *sql.Tx) error) error {
	err := sqltx.Do(ctx, func(ctx context.Context) (*sql.Tx, error) {
		tx, err := db.BeginTx(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("begin: %w", err)
		}
		return tx, nil
	}, fn)
	if ce, ok := err.(*sqltx.CommitError); ok {
		return fmt.Errorf("commit: %w", ce.Err)
	}
	return err
}
