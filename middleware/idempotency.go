package middleware

import (
	"context"
	"fmt"
	"slices"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// NaturalIdempotency recognises "natural" duplicates without a dedup table: a
// processor error that is a unique violation of one of the named constraints means the row
// this message inserts exists, so the message was applied before. It returns an error wrapping
// processor.ErrDuplicate instead, and the router acks.
//
// Only the named constraints count (sqldb.UniqueConstraint says how each database names
// them: the constraint or index name on PostgreSQL, the key name on MySQL and MariaDB,
// "table.column" on SQLite). A unique violation of any other constraint is a conflict with a
// different row, perhaps written by another message: it stays an error, which the default
// classifier makes permanent, so the message is dead-lettered with the reason instead of being
// acknowledged and dropped.
//
// For a version- or state-checked UPDATE that touches no row, the processor decides itself,
// with processor.CheckVersion: a duplicate only when the stored version is at or past the
// message's.
//
// Place it inside Transaction: the violating statement has spoilt the transaction (on
// PostgreSQL it is aborted), which Transaction then rolls back.
func NaturalIdempotency(constraint string, more ...string) Middleware {
	names := append([]string{constraint}, more...)
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			if err == nil || processor.IsDuplicate(err) {
				return err
			}
			if name, ok := sqldb.UniqueConstraint(err); ok && slices.Contains(names, name) {
				return fmt.Errorf("%w: unique violation of %s: %w", processor.ErrDuplicate, name, err)
			}
			return err
		})
	}
}
