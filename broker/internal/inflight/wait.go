package inflight

import "time"

// Signal wakes the goroutine that waits on c, a channel of capacity 1, if any; signals do not
// pile up. Sources use it for their own goroutines as the engine does for its own.
func Signal(c chan struct{}) { signal(c) }

// Pause waits d, and reports false when done is closed first: a source's pause before it
// tries again after a failure, or lets more work gather.
func Pause(done <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-done:
		return false
	}
}

// Stopped reports whether the subscription has begun to stop (Stopping is closed).
func (s *Subscription[T]) Stopped() bool {
	select {
	case <-s.stopping:
		return true
	default:
		return false
	}
}
