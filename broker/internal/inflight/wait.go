package inflight

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// Signal wakes the goroutine that waits on c, a channel of capacity 1, if any; signals do not
// pile up. Sources use it for their own goroutines as the engine does for its own.
func Signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

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

// Wait waits for done until ctx ends.
func Wait(ctx context.Context, done <-chan struct{}) {
	select {
	case <-done:
	case <-ctx.Done():
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

// Context returns a context that ends, with the subscription's cause, when the subscription
// begins to stop (or when Start fails): the context of Fetch, and of a source's own goroutines
// and requests.
func (s *Subscription[T]) Context() context.Context { return s.fetchCtx }

// Outage logs a run of failures of one operation in a row as one: the first at error level,
// the others at debug level, and its end. Log nil logs nothing. What names the operation
// ("claiming messages"). The zero failures count is no outage.
type Outage struct {
	Log  watermill.LoggerAdapter
	What string
	n    int
}

// Failed counts a failure, err, after which the operation is tried again after wait.
func (o *Outage) Failed(err error, wait time.Duration) {
	o.n++
	switch {
	case o.Log == nil:
	case o.n == 1:
		o.Log.Error(o.What+" failed; trying again until it succeeds", err, watermill.LogFields{"wait_time": wait})
	default:
		o.Log.Debug(o.What+" failed again", watermill.LogFields{"err": err.Error(), "failures": o.n})
	}
}

// Ended ends the run of failures, if any, saying so.
func (o *Outage) Ended() {
	if o.n > 0 && o.Log != nil {
		o.Log.Info(o.What+" again", watermill.LogFields{"failures": o.n})
	}
	o.n = 0
}
