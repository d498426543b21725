package inflight_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// writes records the batches a Writer wrote, and what its Wait was asked.
type writes struct {
	mu      sync.Mutex
	batches [][]int
	waits   []int
}

func (w *writes) record(batch []int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.batches = append(w.batches, append([]int(nil), batch...))
}

func (w *writes) got() [][]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.batches
}

func TestWriter_ItemsWithinTheLingerShareOneWrite(t *testing.T) {
	t.Parallel()
	var ws writes
	w := inflight.NewWriter(context.Background(), inflight.WriterOptions[int]{
		Linger: time.Hour, // until Close
		Max:    10,
		Write: func(_ context.Context, batch []int) (int, error) {
			ws.record(batch)
			return len(batch), nil
		},
	})
	for i := 1; i <= 5; i++ {
		w.Add(i)
	}
	left, err := w.Close()
	require.NoError(t, err)
	require.Empty(t, left)
	require.Equal(t, [][]int{{1, 2, 3, 4, 5}}, ws.got())
	w.Add(6) // after Close: dropped
	require.Len(t, ws.got(), 1)
}

func TestWriter_WritesWhatCameDuringAWriteInBatchesOfMaxInOrder(t *testing.T) {
	t.Parallel()
	var ws writes
	entered, gate := make(chan struct{}), make(chan struct{})
	w := inflight.NewWriter(context.Background(), inflight.WriterOptions[int]{
		Max: 2,
		Write: func(_ context.Context, batch []int) (int, error) {
			if batch[0] == 0 {
				close(entered)
				<-gate
			}
			ws.record(batch)
			return len(batch), nil
		},
	})
	w.Add(0)
	<-entered
	for i := 1; i <= 5; i++ {
		w.Add(i)
	}
	close(gate)
	_, err := w.Close()
	require.NoError(t, err)
	require.Equal(t, [][]int{{0}, {1, 2}, {3, 4}, {5}}, ws.got())
}

func TestWriter_AFailedWriteIsTriedAgainWithWhatCameSince(t *testing.T) {
	t.Parallel()
	var ws writes
	failed := errors.New("unreachable")
	entered, gate, written := make(chan struct{}), make(chan struct{}), make(chan struct{})
	w := inflight.NewWriter(context.Background(), inflight.WriterOptions[int]{
		Max: 10,
		Write: func(_ context.Context, batch []int) (int, error) {
			ws.record(batch)
			switch len(ws.got()) {
			case 1:
				close(entered)
				<-gate
				return 0, failed
			case 2:
				return 1, failed // the first is written
			}
			close(written)
			return len(batch), nil
		},
		Wait: func(err error, failures int, closing bool) time.Duration {
			require.Equal(t, failed, err)
			require.False(t, closing)
			ws.mu.Lock()
			ws.waits = append(ws.waits, failures)
			ws.mu.Unlock()
			return 0
		},
	})
	w.Add(1)
	<-entered
	w.Add(2)
	close(gate)
	<-written
	_, err := w.Close()
	require.NoError(t, err)
	require.Equal(t, [][]int{{1}, {1, 2}, {2}}, ws.got())
	require.Equal(t, []int{1, 2}, ws.waits)
}

func TestWriter_CloseReportsWhatItCouldNotWriteBeforeTheContextEnded(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	failed := errors.New("unreachable")
	var closings int
	w := inflight.NewWriter(ctx, inflight.WriterOptions[int]{
		Linger: time.Hour,
		Max:    10,
		Write:  func(context.Context, []int) (int, error) { return 0, failed },
		Wait: func(_ error, _ int, closing bool) time.Duration {
			if closing {
				closings++
				cancel() // Close's time is up
			}
			return time.Hour
		},
	})
	w.Add(1)
	w.Add(2)
	left, err := w.Close()
	require.Equal(t, failed, err)
	require.Equal(t, []int{1, 2}, left)
	require.Equal(t, 1, closings, "tried again once before the context ended")
}
