package inflight

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// WriterOptions configure a Writer.
type WriterOptions[T any] struct {
	// Linger is how long the first item of a batch waits for others before the batch is
	// written, unless Max items are pending already.
	Linger time.Duration
	// Max bounds the items of one Write.
	Max int
	// Write writes batch, in order or reordered in place, and returns how many of it, from
	// the front as it left it, are written: all of them when it returns no error. It runs in
	// the Writer's goroutine, one call at a time.
	Write func(ctx context.Context, batch []T) (int, error)
	// Wait returns how long to wait before trying again after the failures-th failed write
	// in a row, err the last; closing is true once Close has begun.
	Wait func(err error, failures int, closing bool) time.Duration
	// Log, when set, is told of a run of failed writes as an Outage named What ("writing
	// acknowledgements"), and of each failure during Close.
	Log  watermill.LoggerAdapter
	What string
}

// Writer coalesces the settlements of a source (acks, lease changes) into batches that one
// goroutine of its own writes: the first item added waits Options.Linger for others, and then
// everything pending is written in batches of at most Options.Max. A write that fails is kept,
// in front of what came since, and tried again after Options.Wait: nothing is dropped while
// the Writer is open. Close writes what is left and reports what it could not write.
type Writer[T any] struct {
	opt WriterOptions[T]
	ctx context.Context

	mu      sync.Mutex
	pending []T
	closed  bool

	kick chan struct{} // something was added
	stop chan struct{} // closed by Close
	done chan struct{} // closed when run returns
	err  error         // why the last write at Close failed, set before done closes
}

// NewWriter starts a Writer whose writes run under ctx: when ctx ends, a write in progress
// fails, and Close gives up.
func NewWriter[T any](ctx context.Context, opt WriterOptions[T]) *Writer[T] {
	w := &Writer[T]{opt: opt, ctx: ctx, kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go w.run()
	return w
}

// Add queues item to be written. It never waits for a write; an item added once Close has
// begun is dropped.
func (w *Writer[T]) Add(item T) {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.pending = append(w.pending, item)
	w.mu.Unlock()
	Signal(w.kick)
}

// Close stops taking items and writes those pending, trying again after each failure until
// the Writer's context ends. It returns when that is done, with what it could not write and
// the error of the last attempt; nil and nil when everything is written. It must be called
// once.
func (w *Writer[T]) Close() ([]T, error) {
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
	close(w.stop)
	<-w.done
	if w.err == nil {
		return nil, nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending, w.err
}

func (w *Writer[T]) run() {
	defer close(w.done)
	linger := time.NewTimer(0)
	<-linger.C
	outage := Outage{Log: w.opt.Log, What: w.opt.What}
	for {
		select {
		case <-w.kick:
		case <-w.stop:
			w.final(outage.n)
			return
		}
		if w.len() < w.opt.Max {
			linger.Reset(w.opt.Linger)
			select {
			case <-linger.C:
			case <-w.stop:
				linger.Stop()
			}
		}
		err := w.flush()
		if err == nil {
			outage.Ended()
			continue
		}
		wait := w.opt.Wait(err, outage.n+1, false)
		outage.Failed(err, wait)
		Pause(w.stop, wait)
		Signal(w.kick)
	}
}

// final writes what is pending after Close, trying again until the context ends.
func (w *Writer[T]) final(failures int) {
	for {
		err := w.flush()
		if err == nil {
			return
		}
		if w.ctx.Err() != nil {
			w.err = err
			return
		}
		if w.opt.Log != nil {
			w.opt.Log.Error(w.opt.What+" at close failed; trying again", err, nil)
		}
		failures++
		Pause(w.ctx.Done(), w.opt.Wait(err, failures, true))
	}
}

func (w *Writer[T]) len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.pending)
}

// flush writes everything pending, a batch at a time, until a write fails; what that write
// left goes back in front of what came since.
func (w *Writer[T]) flush() error {
	for {
		w.mu.Lock()
		k := min(len(w.pending), w.opt.Max)
		batch := w.pending[:k:k]
		w.pending = w.pending[k:]
		w.mu.Unlock()
		if k == 0 {
			return nil
		}
		n, err := w.opt.Write(w.ctx, batch)
		if err == nil {
			continue
		}
		w.mu.Lock()
		w.pending = append(batch[n:], w.pending...)
		w.mu.Unlock()
		return err
	}
}
