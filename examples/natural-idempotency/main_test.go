package main

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestNaturalIdempotency_EachMessageAppliedOnceWithoutDedupTable(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			s, err := run(context.Background(), t.TempDir(), d.URL(t), slog.New(slog.NewTextHandler(io.Discard, nil)))
			require.NoError(t, err)
			require.Equal(t, 10, s.Deliveries)
			require.Equal(t, 2, s.Payments)
			require.Equal(t, []int{2, 1}, s.Balances)
			require.False(t, s.DedupTable)
			require.Equal(t, int64(0), s.DeadLettered)
		})
	}
}
