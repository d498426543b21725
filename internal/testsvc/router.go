package testsvc

import (
	"context"
	"testing"
	"time"
)

// Runner is what StartRouter runs: a onceflow.Router, or anything with its Run and Running.
type Runner interface {
	Run(ctx context.Context) error
	Running() chan struct{}
}

// StartRouter runs r until the test ends, and returns once it runs; it fails the test when r
// stops before, or does not run within 30 s. When the test ends, it stops r and fails the test
// if Run returned an error.
func StartRouter(t testing.TB, r Runner) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("router: %v", err)
		}
	})
	select {
	case <-r.Running():
	case err := <-done:
		done <- err // for the cleanup
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start within 30 s")
	}
}
