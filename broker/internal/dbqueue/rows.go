package dbqueue

import (
	"database/sql"
	"fmt"
	"strings"
)

// Rows reads every row of a query's result, which QueryContext returned with err, into a T
// each, scanning it into the destinations that dest returns for that T, and closes the result.
func Rows[T any](rows *sql.Rows, err error, dest func(*T) []any) ([]T, error) {
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var out []T
	for rows.Next() {
		var v T
		if err := rows.Scan(dest(&v)...); err != nil {
			return nil, fmt.Errorf("read a row: %w", err)
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// Marks returns "(?, ?, ...)" with n placeholders, an IN list.
func Marks(n int) string {
	return "(" + strings.TrimSuffix(strings.Repeat("?, ", n), ", ") + ")"
}

// Affected returns how many rows a statement, which ExecContext returned with err, affected.
func Affected(res sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}
