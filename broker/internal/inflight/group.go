package inflight

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/onceflow/onceflow/broker/internal/lifecycle"
)

// stopper is a Subscription of any source.
type stopper interface {
	stop(cause error) error
}

// Group is the lifecycle of one scheme's Subscriber: the subscriptions it started, which end
// together when it closes, ErrClosed after that, and a Close that is idempotent and safe to
// call concurrently. The zero value is not usable: NewGroup makes one.
type Group struct {
	errClosed error
	ctx       context.Context
	cancel    context.CancelCauseFunc
	subs      lifecycle.Set[stopper]

	closeOnce sync.Once
	closeErr  error
}

// NewGroup returns an open Group whose Subscriber's error for "closed" is errClosed.
func NewGroup(errClosed error) *Group {
	g := &Group{errClosed: errClosed}
	g.ctx, g.cancel = context.WithCancelCause(context.Background())
	return g
}

// Context ends, with the cause ErrClosed, when Close begins: the context of the work that
// Subscribe does before it starts a subscription (declaring topics, creating consumers).
func (g *Group) Context() context.Context { return g.ctx }

// Setup returns the context of the work that Subscribe does before it starts a subscription
// (declaring topics, creating consumers), which ends when ctx ends or Close begins, and the
// function to call when that work is done.
func (g *Group) Setup(ctx context.Context) (context.Context, context.CancelFunc) {
	setup, cancel := context.WithCancel(ctx)
	unwatch := context.AfterFunc(g.ctx, cancel)
	return setup, func() {
		unwatch()
		cancel()
	}
}

// SetupError is the error of a Subscribe whose setup failed with err: ErrClosed when the Group
// closed meanwhile, err otherwise.
func (g *Group) SetupError(err error) error {
	if closed := g.Check(); closed != nil {
		return closed
	}
	return err
}

// Begin returns why a Subscribe to topic cannot begin, nil when it can: an empty topic, in
// an error that names scheme, or else ErrClosed when the Group is closed.
func (g *Group) Begin(scheme, topic string) error {
	if topic == "" {
		return fmt.Errorf("%s: subscribe: topic is empty", scheme)
	}
	return g.Check()
}

// Check returns ErrClosed when the Group is closed.
func (g *Group) Check() error {
	if g.subs.Closed() {
		return g.errClosed
	}
	return nil
}

// Close stops every subscription at once, with the cause ErrClosed, waits until they have
// ended, then runs after (nil for nothing): what the subscriptions shared, a connection. It
// returns their errors and after's, joined. It is idempotent: every call returns when the
// first is done, with its result.
func (g *Group) Close(after func() error) error {
	g.closeOnce.Do(func() {
		subs, _ := g.subs.Close()
		g.cancel(g.errClosed)
		errs := make([]error, len(subs)+1)
		var wg sync.WaitGroup
		for i, s := range subs {
			wg.Go(func() { errs[i] = s.stop(g.errClosed) })
		}
		wg.Wait()
		if after != nil {
			errs[len(subs)] = after()
		}
		g.closeErr = errors.Join(errs...)
	})
	return g.closeErr
}
