package middleware

import (
	"context"
	"fmt"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// NaturalIdempotency recognises seed 000's "natural" duplicates without a dedup table: a
// processor error that is a unique-key violation (PostgreSQL 23505, MySQL 1062, SQLite
// SQLITE_CONSTRAINT_UNIQUE/PRIMARYKEY) means the row this message inserts exists, so the
// message was applied before. It returns an error wrapping processor.ErrDuplicate instead, and
// the router acks. For a version- or state-checked UPDATE that touches no row, the processor
// returns processor.AlreadyProcessed itself (processor.RowsAffectedOrDuplicate does it).
//
// Place it inside Transaction: the violating statement has spoilt the transaction (on
// PostgreSQL it is aborted), which Transaction then rolls back.
func NaturalIdempotency() Middleware {
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			if err != nil && !processor.IsDuplicate(err) && sqldb.IsUniqueViolation(err) {
				return fmt.Errorf("%w: unique violation: %w", processor.ErrDuplicate, err)
			}
			return err
		})
	}
}
