package connect_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/connect"
)

func TestParseTimeout(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]time.Duration{"300ms": 300 * time.Millisecond, "10s": 10 * time.Second, "5": 5 * time.Second, "0": 0} {
		got, err := connect.ParseTimeout(v)
		require.NoError(t, err, v)
		require.Equal(t, want, got, v)
	}
	for _, v := range []string{"", "soon", "-1s", "-3", "1.5"} {
		_, err := connect.ParseTimeout(v)
		require.Error(t, err, v)
		require.ErrorContains(t, err, "connect_timeout=")
	}
}

func TestExplain_SaysTheTimeoutRanOutOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	deadline := fmt.Errorf("dial 10.0.0.1:5432: %w", context.DeadlineExceeded)

	err := connect.Explain(ctx, time.Second, deadline)
	require.EqualError(t, err, "no answer within 1s (connect_timeout): dial 10.0.0.1:5432: context deadline exceeded")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	wrapped := fmt.Errorf("open: %w", err)
	require.Same(t, wrapped, connect.Explain(ctx, time.Second, wrapped), "explained once")

	ioTimeout := fmt.Errorf("read tcp: %w", os.ErrDeadlineExceeded)
	require.ErrorContains(t, connect.Explain(ctx, time.Second, ioTimeout), "no answer within 1s")

	refused := errors.New("connection refused")
	require.Same(t, refused, connect.Explain(ctx, time.Second, refused))

	ended, cancel := context.WithCancel(ctx)
	cancel()
	require.Same(t, deadline, connect.Explain(ended, time.Second, deadline), "the caller's context ended the wait")
	require.Same(t, deadline, connect.Explain(ctx, 0, deadline), "no timeout, nothing to blame")
	require.NoError(t, connect.Explain(ctx, time.Second, nil))
}
