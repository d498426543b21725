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

func TestOutbox_EachOrderShippedOnceThroughTheRelay(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			s, err := run(context.Background(), dir, d.URL(t), 100, slog.New(slog.NewTextHandler(io.Discard, nil)))
			require.NoError(t, err)

			require.Equal(t, 100, s.Orders)
			require.Equal(t, 120, s.Deliveries)
			require.Equal(t, 100, s.OrderRows)
			require.Equal(t, 100, s.ShipmentRows)
			require.GreaterOrEqual(t, s.Relayed, 110, "every tenth publish lost its confirmation and was sent again")
			require.Zero(t, s.OutboxBacklog)

			var out bytes.Buffer
			report(&out, dir, s)
			require.Contains(t, out.String(), "order rows: 100, shipment rows: 100 (one each per order: exactly once)")
		})
	}
}
