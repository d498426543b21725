package dedup

import (
	"context"

	"github.com/onceflow/onceflow/internal/sqllock"
)

// HoldPurgeLock takes s's purge lock the way a Purge in another process would, so that tests
// can run a Purge against a held lock. held is false when someone else holds it.
func HoldPurgeLock(ctx context.Context, s *SQLStore) (release func() error, held bool, err error) {
	return sqllock.TryLock(ctx, s.db, s.purgeLockName())
}

// MariaDBReturns exposes mariaDBReturns.
var MariaDBReturns = mariaDBReturns

// WithoutReturning makes s, a store on MySQL or MariaDB, record many keys as it does on MySQL,
// which has no INSERT ... RETURNING.
func WithoutReturning(s *SQLStore) {
	if m, ok := s.dialect.(*mysql); ok {
		m.returningOnce.Do(func() {})
		m.canReturn = false
	}
}
