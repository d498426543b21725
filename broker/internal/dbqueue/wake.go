package dbqueue

import (
	"context"
	"sync"
	"time"
)

// Wakes are the wake-ups of a queue's idle subscriptions, per topic: a subscription takes
// Woken before it looks for messages, and waits on it after it found none; Wake closes it.
// The zero value is ready to use; it is safe for concurrent use.
type Wakes struct {
	mu sync.Mutex
	ch map[string]chan struct{}
}

// Woken returns a channel that the next Wake of topic closes.
func (w *Wakes) Woken(topic string) <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	ch, ok := w.ch[topic]
	if !ok {
		if w.ch == nil {
			w.ch = map[string]chan struct{}{}
		}
		ch = make(chan struct{})
		w.ch[topic] = ch
	}
	return ch
}

// Wake wakes the subscriptions waiting for messages of topic.
func (w *Wakes) Wake(topic string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if ch, ok := w.ch[topic]; ok {
		close(ch)
		delete(w.ch, topic)
	}
}

// Wait waits d, or until woken is closed (nil: never) or ctx ends, whichever comes first: a
// subscription's pause before it looks for messages again.
func Wait(ctx context.Context, d time.Duration, woken <-chan struct{}) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-woken:
	case <-ctx.Done():
	}
}
