package dbqueue_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

func TestWakes_WakeClosesTheTopicsWokenOnly(t *testing.T) {
	t.Parallel()
	var w dbqueue.Wakes
	a, b := w.Woken("a"), w.Woken("b")
	require.Equal(t, a, w.Woken("a"), "one channel per topic until its Wake")
	w.Wake("a")
	w.Wake("c") // nobody waits: nothing to do
	requireClosed(t, a, true)
	requireClosed(t, b, false)
	next := w.Woken("a")
	require.NotEqual(t, a, next, "a Wake ends its channel: the next Woken waits for the next Wake")
	requireClosed(t, next, false)
}

func TestWait_EndsWithTheFirstOfTheTimeTheWakeAndTheContext(t *testing.T) {
	t.Parallel()
	woken := make(chan struct{})
	close(woken)
	start := time.Now()
	dbqueue.Wait(context.Background(), time.Hour, woken)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	dbqueue.Wait(ctx, time.Hour, nil)
	dbqueue.Wait(context.Background(), time.Millisecond, nil)
	require.Less(t, time.Since(start), time.Minute)
}

func requireClosed(t *testing.T, ch <-chan struct{}, want bool) {
	t.Helper()
	select {
	case <-ch:
		require.True(t, want, "closed")
	default:
		require.False(t, want, "not closed")
	}
}
