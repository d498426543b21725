package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestMigrate_OrderingCreatesTheOrderingTables(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			url := d.URL(t)
			for range 2 { // idempotent
				out, err := run(t, "migrate", "--db", url, "--ordering")
				require.NoError(t, err)
				require.Contains(t, out, "ordering tables onceflow_order_state, onceflow_order_parked, onceflow_order_skipped, sequence table onceflow_order_seq")
			}
		})
	}
}
