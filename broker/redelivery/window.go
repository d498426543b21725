package redelivery

import "context"

// A consumer knows how many deliveries it can take at once from each of its subscriptions (a
// router that commits its messages in groups takes a group running and the next one
// collecting); a subscriber knows only its prefetch, which its user may have left unset. The
// consumer says the first on the context it subscribes with (WithWindow); a subscriber whose
// prefetch was left to its default holds that many deliveries unsettled instead, when that is
// more than its default and within its bounds (WindowFrom). A prefetch its user set always
// wins.

type windowKey struct{}

// WithWindow returns a copy of ctx, the context of a Subscribe call, that asks the subscriber
// for a window of n deliveries: how many of the subscription's deliveries the consumer can
// take at once. n below 1 asks for nothing.
func WithWindow(ctx context.Context, n int) context.Context {
	if n < 1 {
		return ctx
	}
	return context.WithValue(ctx, windowKey{}, n)
}

// WindowFrom returns the window of a subscription whose prefetch was left to the subscriber's
// default def: the window the consumer asked for on ctx, the context of the Subscribe call
// (WithWindow), when it is more than def, at most limit (no bound when limit is 0); def
// otherwise.
func WindowFrom(ctx context.Context, def, limit int) int {
	n, ok := ctx.Value(windowKey{}).(int)
	if !ok || n <= def {
		return def
	}
	if limit > 0 {
		n = min(n, limit)
	}
	return n
}
