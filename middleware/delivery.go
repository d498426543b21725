package middleware

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/delivery"
)

// Delivery is what the middlewares of one delivery have recorded about it, for the others to
// read: how often its processing ran again, how many of its message's deliveries began, and
// whether and when the transaction that applied it committed. The router starts one for every
// delivery it runs, and StartDelivery does for a chain run elsewhere. The built-in middlewares
// record in it (Retry its retries, Transaction and GroupCommit the commit) and read it
// (Metrics counts the retries, Tracing reports the attempts, DeadLetter counts the deliveries
// against its limit, the router measures the commit-to-ack latency); a custom middleware that
// takes the place of one of them records the same with RecordRetry and RecordCommit, and
// reads what the others recorded with DeliveryFrom, as watermill's router context is read.
//
// A Delivery is a view: its methods return what has been recorded so far. The zero Delivery,
// of a context without one, records nothing.
type Delivery struct{ st *delivery.State }

// DeliveryFrom returns the Delivery that ctx was started for (by the router or
// StartDelivery), or the zero Delivery and false.
func DeliveryFrom(ctx context.Context) (Delivery, bool) {
	st := delivery.From(ctx)
	return Delivery{st: st}, st != nil
}

// StartDelivery returns a context that records what the middlewares of one delivery of
// handler's messages learn about it, received now: under it, a chain run without the router
// has its retries counted by Metrics and its attempts reported by Tracing as under the router.
// The router starts its own for each delivery; a chain run under it needs none. Tracing ends
// the consumer span of such a delivery when the chain returns, since no router acknowledges it.
func StartDelivery(ctx context.Context, handler string) context.Context {
	ctx, st := delivery.Start(ctx, handler, time.Now())
	st.EndSpanInChain = true
	return ctx
}

// RecordRetry records in the Delivery of ctx, if any, that its processing is about to run
// again: a retrying middleware calls it before each attempt after the first, as Retry does.
func RecordRetry(ctx context.Context) {
	if st := delivery.From(ctx); st != nil {
		st.Retries++
	}
}

// RecordCommit records in the Delivery of ctx, if any, that the transaction that applied its
// message committed at at: a middleware that runs the transaction calls it after a successful
// commit, as Transaction and GroupCommit do. The router then measures the commit-to-ack
// latency from at, and reports a lost acknowledgement of a committed message as committed.
func RecordCommit(ctx context.Context, at time.Time) { delivery.MarkCommitted(ctx, at) }

// Handler returns the name of the handler that processes the delivery.
func (d Delivery) Handler() string {
	if d.st == nil {
		return ""
	}
	return d.st.Handler
}

// Received returns when the delivery was received.
func (d Delivery) Received() time.Time {
	if d.st == nil {
		return time.Time{}
	}
	return d.st.Received
}

// Retries returns how many times the processing of the delivery ran again after its first
// attempt, as recorded by RecordRetry so far.
func (d Delivery) Retries() int {
	if d.st == nil {
		return 0
	}
	return d.st.Retries
}

// DeliveriesBegun returns how many deliveries of the message began processing, this one
// included, where the router counts them durably for the delivery limit (a redelivery of a
// handler whose broker does not count deliveries); 0 when they are not counted, and
// messagedata.MessageData.Delivery is the count to go by, and 0 too when the router could not
// record this delivery's attempt (AttemptUnrecorded).
func (d Delivery) DeliveriesBegun() int {
	if d.st == nil {
		return 0
	}
	return d.st.Attempts
}

// AttemptUnrecorded reports whether the router counts the deliveries that began processing but
// could not record this one (its database was unreachable): no count then tells how many
// began, and DeadLetter applies no delivery limit to this delivery.
func (d Delivery) AttemptUnrecorded() bool { return d.st != nil && d.st.AttemptUnrecorded }

// CommittedAt returns when the transaction that applied the message committed, as recorded
// by RecordCommit, and false while it has not.
func (d Delivery) CommittedAt() (time.Time, bool) {
	if d.st == nil || d.st.CommittedAt.IsZero() {
		return time.Time{}, false
	}
	return d.st.CommittedAt, true
}

// HandOverSpan gives span, the consumer span of the delivery, to the router that runs it,
// which records the acknowledgement as its child span and ends it then, after the chain has
// returned. It returns false when there is no router to end it (a context without a Delivery,
// or one from StartDelivery) or a span was handed over already: the caller ends span itself.
// Tracing calls it; a tracing middleware of one's own calls it in Tracing's place.
func (d Delivery) HandOverSpan(span trace.Span) bool {
	if d.st == nil || d.st.EndSpanInChain || d.st.Span != nil {
		return false
	}
	d.st.Span = span
	return true
}
