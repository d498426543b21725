package middleware

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/internal/delivery"
)

// Delivery is what the stages of one delivery have recorded about it, for the others to read:
// how often its processing ran again, how many of its message's deliveries began, whether and
// when the transaction that applied it committed, and which errors its dead-letter stage takes
// for permanent. The router starts one for every delivery it runs. The built-in stages record
// in it (Retry its retries, the transaction the commit, DeadLetter its classifier) and read it
// (Metrics counts the retries, Tracing reports the attempts, DeadLetter counts the deliveries
// against its limit, the router measures the commit-to-ack latency); a middleware of one's own
// reads it with DeliveryFrom, as watermill's router context is read.
//
// A Delivery is a view: its methods return what has been recorded so far. The zero Delivery,
// of a context without one, records nothing.
type Delivery struct{ st *delivery.State }

// DeliveryFrom returns the Delivery that the router started ctx for, or the zero Delivery and
// false.
func DeliveryFrom(ctx context.Context) (Delivery, bool) {
	st := delivery.From(ctx)
	return Delivery{st: st}, st != nil
}

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
// attempt, as the retry stage recorded so far.
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

// CommittedAt returns when the transaction that applied the message committed, as the
// transaction stage recorded it, and false while it has not.
func (d Delivery) CommittedAt() (time.Time, bool) {
	if d.st == nil || d.st.CommittedAt.IsZero() {
		return time.Time{}, false
	}
	return d.st.CommittedAt, true
}

// Permanent reports whether err is an error that running the message again cannot cure, as
// the chain's dead-letter stage classifies it (DeadLetter.Classifier; DefaultClassifier when
// the chain has no dead-letter stage, or for the zero Delivery). Retry asks it, and so may a
// retrying middleware of one's own.
func (d Delivery) Permanent(err error) bool {
	if d.st != nil && d.st.Classify != nil {
		return d.st.Classify(err)
	}
	return DefaultClassifier(err)
}
