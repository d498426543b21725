package main

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestInterceptorChain_OneOfItsOwnInTheCanonicalChainWithMessageLog(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			check(t, d.URL(t))
		})
	}
}

func check(t *testing.T, dbURL string) {
	s, err := run(context.Background(), t.TempDir(), dbURL, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)

	require.Equal(t, "tracing -> metrics -> audit -> deadletter -> recover -> retry -> timeout -> transaction -> deduplicate", s.Chain)
	require.Equal(t, []string{
		"audit: handler=orders message=order-1 outcome=processed",
		"audit: handler=orders message=order-2 outcome=processed",
		"audit: handler=orders message=order-2 outcome=duplicate",
		"audit: handler=orders message=order-3 outcome=processed",
	}, s.Audit)
	require.Equal(t, 3, s.Orders)
	require.Equal(t, 3, s.MessageLog)
	require.Equal(t, map[string]int64{"processed": 3, "duplicate": 1}, s.ByOutcome)
	require.Contains(t, s.Spans, "process orders")
	require.Contains(t, s.Spans, "onceflow.commit")
	require.Contains(t, s.Spans, "onceflow.dedup")
	require.Contains(t, s.Spans, "ack orders")
}
