package console

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
)

func TestRouterSource_RateIsOverTheLastMinuteOfSamples(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 9, 0, 0, 0, time.UTC)
	running := onceflow.State{Kind: onceflow.StateRunning, Since: t0.Add(-2 * time.Second)}
	status := func(processed int64) onceflow.HandlerStatus {
		return onceflow.HandlerStatus{Name: "ledger", State: running, Counts: onceflow.HandlerCounts{Processed: processed, Failed: 1}}
	}
	s := &routerSource{samples: map[string][]sample{}}

	// Before any sample a second old: the average since the handler started.
	require.InDelta(t, 11.0/2, s.rate(status(10), t0), 1e-9)
	require.InDelta(t, 40.0/10, s.rate(status(50), t0.Add(10*time.Second)), 1e-9, "the deliveries since the first sample")
	require.InDelta(t, 40.0/10.5, s.rate(status(50), t0.Add(10500*time.Millisecond)), 1e-9, "no sample under a second after the last")
	require.Len(t, s.samples["ledger"], 2)
	// A minute on, the samples older than the window go but one, which spans it.
	require.InDelta(t, 60.0/60, s.rate(status(110), t0.Add(70*time.Second)), 1e-9)
	require.Len(t, s.samples["ledger"], 2)
	// Nothing more: the rate falls to 0 once the window holds no delivery.
	require.InDelta(t, 0, s.rate(status(110), t0.Add(131*time.Second)), 1e-9)
}
