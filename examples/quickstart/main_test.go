package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestQuickstart_EachPaymentBookedOnceAndMalformedDeadLettered(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			s, err := run(context.Background(), dir, d.URL(t), 200, slog.New(slog.NewTextHandler(io.Discard, nil)))
			require.NoError(t, err)

			require.Equal(t, 200, s.Distinct)
			require.Equal(t, 220, s.Deliveries)
			require.Equal(t, 200, s.LedgerRows)
			require.Equal(t, int64(1), s.DeadLettered)
			require.Contains(t, s.Reason, `decode JSON payload of message "payment-malformed"`)

			var out bytes.Buffer
			report(&out, dir, s)
			require.Contains(t, out.String(), "ledger rows: 200 (one per payment: exactly once)")
		})
	}
}
