// Package delivery carries per-delivery bookkeeping through the context, from the middlewares
// that know a fact (the commit happened, an attempt was retried) to the ones that report it
// (metrics, tracing, the router's ack).
package delivery

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/txctx"
	"github.com/onceflow/onceflow/messagedata"
)

// State is what the middlewares of one delivery learn about it. One goroutine owns it at a
// time: the chain runs synchronously. Under group commit, the chain inside the group runs in
// the group's goroutine while the delivery's own goroutine waits for it; the delivery's
// goroutine records CommittedAt itself, from the group's result.
type State struct {
	// Handler is the name of the handler processing the delivery.
	Handler string
	// Received is when the router received the delivery.
	Received time.Time
	// CommittedAt is when the transaction that applied the message committed; zero until then.
	CommittedAt time.Time
	// Retries counts the attempts after the first.
	Retries int
	// Attempts counts the deliveries of the message whose processing began, this one
	// included, where the router records them (a redelivery, of a handler with a delivery
	// limit); 0 when unknown.
	Attempts int
	// AttemptUnrecorded is set when the router records the attempts of the message but could
	// not record this one (its database was unreachable): no count tells how many deliveries
	// began, and the delivery limit does not apply to this delivery.
	AttemptUnrecorded bool
	// AttemptOnNack is set for a message's first redelivery, which the router runs with
	// the others, its attempt not recorded before it begins: the router records the attempt
	// when the delivery is nacked (it failed, panicked or lost its acknowledgement), so that
	// the later deliveries count it. One that ends without an outcome (its consumer died or
	// stopped) is not counted.
	AttemptOnNack bool
	// Known is how many deliveries of the message the router's records show, this one
	// included, where it records them (from a message's second redelivery); 0 otherwise.
	Known int
	// Uncounted is how many deliveries of the message, among those that the broker (or the
	// router's durable count) counts, the router gave back unprocessed during outages: the
	// delivery limit does not count them.
	Uncounted int
	// GivesBackOutages is set when the router gives a delivery that fails by an outage
	// (sqldb.IsOutage) back to the broker and pauses the handler: the retry stage then does
	// not retry such a failure in process.
	GivesBackOutages bool
	// Span is the consumer span the Tracing middleware started, left open for the router to
	// record the acknowledgement in and end; nil when the delivery is not traced.
	Span trace.Span
	// EndSpanInChain is set for a delivery that no router settles (tests):
	// its consumer span ends when the chain returns, and Span stays nil.
	EndSpanInChain bool
	// Joined is set for a delivery whose first attempt ran already, in a group its consumer
	// joined it to directly (groupcommit.Joiner), and failed with JoinedErr: the group
	// interceptor of the chain the consumer then runs it through returns JoinedErr, once, in
	// place of running that attempt again.
	Joined    bool
	JoinedErr error
	// Classify is the classifier of the chain's dead-letter stage, which it records on entry:
	// the stages inside it (Retry) ask it which errors are permanent. Nil: DefaultClassifier.
	Classify func(error) bool
	// Records are the handler's durable records that its dead-letter and duplicate-detection
	// stages consult and keep under the router; nil outside it.
	Records *Records
	// tx is the transaction of the attempt that runs, put by WithTx; nil between attempts.
	tx any
	// Metered is set while the metrics stage (the outermost, when a chain has several) times
	// the delivery, from MeteredFrom, when it had MeteredRetries retries: the stage keeps them
	// here rather than in a context of its own.
	Metered        bool
	MeteredFrom    time.Time
	MeteredRetries int
	// EndsGroup is set for the last delivery of a group (groupcommit.Joiner) that its
	// consumer settles at once, as the group hands out its results: after its acknowledgement
	// the consumer tells the subscriber to send the acknowledgements it holds back
	// (redelivery.Flush), so that the group's go to the broker together, without waiting for
	// more.
	EndsGroup bool
}

// Attempt is the processing attempt of the delivery, from 1: the one its log lines and its dead
// letter report.
func (s *State) Attempt() int { return s.Retries + 1 }

// Delivery is the delivery count its log lines and its dead letter report, given counted, the
// broker's or the durable counter's (MessageData.Delivery): the router's records (Attempts,
// Known) when they show more deliveries than counted says (a count lost with a consumer that
// died), counted otherwise.
func (s *State) Delivery(counted int) int { return max(counted, s.Attempts, s.Known) }

// Records are what the router keeps for a handler's built-in stages, beyond the chain: its
// durable record of dead letters and of processed redeliveries (in the delivery counter) for
// the dead-letter stage, and the report of a message delivered beyond the dedup retention (a
// metric and a log line). A nil function does nothing.
type Records struct {
	// DeadLettered reports whether msg was dead-lettered before; MarkDeadLettered records that
	// it was.
	DeadLettered     func(ctx context.Context, msg *messagedata.MessageData) (bool, error)
	MarkDeadLettered func(ctx context.Context, msg *messagedata.MessageData) error
	// Processed reports whether msg was processed (its commit stands), for a message over its
	// delivery limit; MarkProcessed records that a redelivery of msg was, for a chain without
	// duplicate detection to answer Processed.
	Processed     func(ctx context.Context, msg *messagedata.MessageData) (bool, error)
	MarkProcessed func(ctx context.Context, msg *messagedata.MessageData) error
	// BeyondRetention reports msg, delivered beyond the dedup retention, with the reason.
	BeyondRetention func(ctx context.Context, msg *messagedata.MessageData, reason string)
}

// HandOverSpan gives span, the consumer span of the delivery of st, to the router that runs
// it, which records the acknowledgement as its child span and ends it. It returns false when
// there is no router to end it (st is nil, or its span ends in the chain) or a span was handed
// over already: the caller ends span itself.
func HandOverSpan(st *State, span trace.Span) bool {
	if st == nil || st.EndSpanInChain || st.Span != nil {
		return false
	}
	st.Span = span
	return true
}

type key struct{}

// With returns a context carrying st.
func With(ctx context.Context, st *State) context.Context { return context.WithValue(ctx, key{}, st) }

// Start returns a context carrying a new State of a delivery to handler received at received,
// and that State: one allocation for both, where With takes two.
func Start(ctx context.Context, handler string, received time.Time) (context.Context, *State) {
	c := &stateContext{Context: ctx, st: State{Handler: handler, Received: received}}
	return c, &c.st
}

// StartWith is Start for a caller that keeps state of its own for each delivery, an E: the
// context, the State and a zero E, which it returns too, take one allocation.
func StartWith[E any](ctx context.Context, handler string, received time.Time) (context.Context, *State, *E) {
	c := &stateContextWith[E]{stateContext: stateContext{Context: ctx, st: State{Handler: handler, Received: received}}}
	return &c.stateContext, &c.st, &c.extra
}

// stateContextWith is a stateContext with a caller's state beside it (StartWith).
type stateContextWith[E any] struct {
	stateContext
	extra E
}

// stateContext is a context carrying a State, which it holds itself. The context package treats
// it as its parent (Deadline, Done, Err and every other value are the parent's): a context
// derived from it with a cancel registers with the parent's, as it would through WithValue.
type stateContext struct {
	context.Context
	st State
}

func (c *stateContext) Value(k any) any {
	switch k {
	case key{}:
		return &c.st
	case stateContextKey{}:
		return c
	}
	if c.st.tx != nil && txctx.IsTxKey(k) {
		return c.st.tx
	}
	return c.Context.Value(k)
}

// stateContextKey finds the stateContext of a delivery.
type stateContextKey struct{}

// WithTx returns a context that carries tx, for one attempt at processing a delivery, and the
// State to give to EndTx when the attempt ends. The context of a delivery that Start began,
// with no transaction in it yet, carries tx in its State: the delivery's contexts answer for it
// as a context of txctx.WithTx would, and the attempt costs no allocation for it. Any other
// context is returned as txctx.WithTx(ctx, tx), with a nil State.
func WithTx(ctx context.Context, tx any) (context.Context, *State) {
	if c, ok := ctx.Value(stateContextKey{}).(*stateContext); ok && txctx.Tx(ctx) == nil {
		c.st.tx = tx
		return ctx, &c.st
	}
	return txctx.WithTx(ctx, tx), nil
}

// EndTx takes the transaction that WithTx put in s out of the delivery's contexts: the attempt
// has ended. A nil s does nothing.
func (s *State) EndTx() {
	if s != nil {
		s.tx = nil
	}
}

// From returns the State in ctx, or nil.
func From(ctx context.Context) *State {
	st, _ := ctx.Value(key{}).(*State)
	return st
}

// MarkCommitted records the commit time on the State in ctx, if any.
func MarkCommitted(ctx context.Context, at time.Time) {
	if st := From(ctx); st != nil {
		st.CommittedAt = at
	}
}
