package middleware

import (
	"context"
	"fmt"
	"slices"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// naturalIdempotency takes a unique violation of one of the constraints names for an earlier
// delivery of the message (DedupNatural), and returns an error wrapping processor.ErrDuplicate
// instead.
func naturalIdempotency(names []string) Middleware {
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
