package sqldb_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
)

// rows is a table of n purgeable rows that each batch deletes from.
func rows(n int64, sizes *[]int) func(context.Context, int) (int64, error) {
	return func(_ context.Context, batch int) (int64, error) {
		*sizes = append(*sizes, batch)
		d := min(n, int64(batch))
		n -= d
		return d, nil
	}
}

func TestPurgeBatches_RunsUntilABatchFindsFewerRows(t *testing.T) {
	var sizes []int
	res, err := sqldb.PurgeBatches(context.Background(), sqldb.PurgeOptions{}, rows(2500, &sizes))
	require.NoError(t, err)
	require.Equal(t, sqldb.PurgeResult{Deleted: 2500, Batches: 3}, res)
	require.Equal(t, []int{1000, 1000, 1000}, sizes, "DefaultPurgeBatchSize rows per batch")

	sizes = nil
	res, err = sqldb.PurgeBatches(context.Background(), sqldb.PurgeOptions{BatchSize: 10, MaxBatches: 2}, rows(100, &sizes))
	require.NoError(t, err)
	require.Equal(t, sqldb.PurgeResult{Deleted: 20, Batches: 2}, res, "MaxBatches stops it")
}

func TestPurgeBatches_ErrorNamesTheBatchAndKeepsTheCount(t *testing.T) {
	calls := 0
	res, err := sqldb.PurgeBatches(context.Background(), sqldb.PurgeOptions{BatchSize: 5}, func(context.Context, int) (int64, error) {
		calls++
		if calls == 3 {
			return 0, errors.New("connection reset")
		}
		return 5, nil
	})
	require.EqualError(t, err, "batch 3: connection reset")
	require.Equal(t, sqldb.PurgeResult{Deleted: 10, Batches: 2}, res)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = sqldb.PurgeBatches(ctx, sqldb.PurgeOptions{}, func(context.Context, int) (int64, error) { return 0, nil })
	require.ErrorIs(t, err, context.Canceled)
}

func TestPurgeOptions_ValidateNamesTheField(t *testing.T) {
	require.EqualError(t, sqldb.PurgeOptions{BatchSize: -1}.Validate(), "BatchSize: must not be negative, got -1")
	require.EqualError(t, sqldb.PurgeOptions{MaxBatches: -2}.Validate(), "MaxBatches: must not be negative, got -2")
	require.NoError(t, sqldb.PurgeOptions{}.Validate())
}
