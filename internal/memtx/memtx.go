// Package memtx is an in-memory stand-in for a database, for the tests and benchmarks that
// measure what a chain costs without one: every statement succeeds at once.
package memtx

import (
	"context"
	"database/sql"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/middleware"
)

// Tx is a transaction in which every statement succeeds at once, doing nothing.
type Tx struct{}

var _ middleware.Tx = Tx{}

func (Tx) DriverName() string                               { return "memory" }
func (Tx) Rebind(q string) string                           { return q }
func (Tx) BindNamed(q string, _ any) (string, []any, error) { return q, nil, nil }
func (Tx) QueryContext(context.Context, string, ...any) (*sql.Rows, error) {
	return nil, nil
}
func (Tx) QueryxContext(context.Context, string, ...any) (*sqlx.Rows, error) {
	return nil, nil
}
func (Tx) QueryRowxContext(context.Context, string, ...any) *sqlx.Row { return nil }
func (Tx) ExecContext(context.Context, string, ...any) (sql.Result, error) {
	return nil, nil
}
func (Tx) Commit() error   { return nil }
func (Tx) Rollback() error { return nil }

// DB begins Tx transactions.
type DB struct{}

// BeginTx returns a Tx.
func (DB) BeginTx(context.Context, *sql.TxOptions) (middleware.Tx, error) { return Tx{}, nil }
