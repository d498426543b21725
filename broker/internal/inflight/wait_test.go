package inflight_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

func TestPause_ReportsWhetherItWaitedItsTime(t *testing.T) {
	t.Parallel()
	require.True(t, inflight.Pause(nil, time.Millisecond))
	done := make(chan struct{})
	close(done)
	require.False(t, inflight.Pause(done, time.Hour))
}

func TestSignal_DoesNotPileUp(t *testing.T) {
	t.Parallel()
	c := make(chan struct{}, 1)
	inflight.Signal(c)
	inflight.Signal(c) // does not block
	require.Len(t, c, 1)
}

func TestGroup_SetupEndsWithCloseAndItsErrorIsErrClosed(t *testing.T) {
	t.Parallel()
	errClosed := errors.New("closed")
	g := inflight.NewGroup(errClosed)
	setup, stop := g.Setup(context.Background())
	defer stop()
	failed := errors.New("declare failed")
	require.Equal(t, failed, g.SetupError(failed), "open: the setup's own error")
	require.NoError(t, g.Close(nil))
	select {
	case <-setup.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the setup context did not end with Close")
	}
	require.Equal(t, errClosed, g.SetupError(failed))
}
