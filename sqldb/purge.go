package sqldb

import (
	"cmp"
	"context"
	"fmt"
)

// DefaultPurgeBatchSize is the batch size of a purge whose PurgeOptions.BatchSize is zero.
const DefaultPurgeBatchSize = 1000

// PurgeOptions bounds a purge of rows that are no longer needed (expired dedup keys and
// delivery counts, sent outbox messages): it deletes them in batches, each its own short
// statement outside any transaction, so that no lock is held for long.
type PurgeOptions struct {
	// BatchSize is the number of rows one DELETE removes at most. Must not be negative.
	// Defaults to DefaultPurgeBatchSize.
	BatchSize int
	// MaxBatches stops the purge after this many batches even if purgeable rows remain; 0 runs
	// until none is left. Must not be negative.
	MaxBatches int
}

// Validate reports a negative field, named.
func (o PurgeOptions) Validate() error {
	if o.BatchSize < 0 {
		return fmt.Errorf("BatchSize: must not be negative, got %d", o.BatchSize)
	}
	if o.MaxBatches < 0 {
		return fmt.Errorf("MaxBatches: must not be negative, got %d", o.MaxBatches)
	}
	return nil
}

// PurgeResult says what one purge did.
type PurgeResult struct {
	// Deleted is the number of rows deleted.
	Deleted int64
	// Batches is the number of DELETE statements run, including a last one that found fewer
	// rows than BatchSize.
	Batches int
	// Skipped is true when another purge of the same table held its lock: nothing was done.
	Skipped bool
}

// PurgeBatches runs del, which deletes at most batch rows and returns how many it deleted,
// until a batch deletes fewer than the batch size, opts.MaxBatches batches have run, or ctx
// ends. On error, the result counts what was deleted before it, and the error says which
// batch failed. opts must be valid.
func PurgeBatches(ctx context.Context, opts PurgeOptions, del func(ctx context.Context, batch int) (int64, error)) (PurgeResult, error) {
	var res PurgeResult
	batch := cmp.Or(opts.BatchSize, DefaultPurgeBatchSize)
	for opts.MaxBatches == 0 || res.Batches < opts.MaxBatches {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		n, err := del(ctx, batch)
		if err != nil {
			return res, fmt.Errorf("batch %d: %w", res.Batches+1, err)
		}
		res.Deleted += n
		res.Batches++
		if n < int64(batch) {
			break
		}
	}
	return res, nil
}

// PurgeExec runs a DELETE of one batch as PurgeBatches wants it: query with args, returning the
// rows it affected.
func (db *DB) PurgeExec(ctx context.Context, query string, args ...any) (int64, error) {
	r, err := db.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	n, err := r.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("read rows affected: %w", err)
	}
	return n, nil
}
