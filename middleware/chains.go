package middleware

import "errors"

// Stages are the middlewares of a canonical chain, each by its place in it. AtLeastOnce,
// ExactlyOnce and ExactlyOnceInOrder compose them in the canonical order, outermost first:
//
//	Tracing -> Metrics -> DeadLetter -> Recover -> Retry -> Timeout -> Transaction -> Deduplicate -> InOrder
//
// so that a program that composes its own chain need not know the order, nor its two rules
// (Retry outside Transaction, Deduplicate inside it). A nil stage is left out; the function of
// each level says which stages it needs. A middleware of one's own goes around the result
// with Chain, or takes the place of the built-in whose stage it fills.
type Stages struct {
	Tracing    Middleware // Tracing
	Metrics    Middleware // Metrics
	DeadLetter Middleware // DeadLetter
	Recover    Middleware // Recover
	Retry      Middleware // Retry
	Timeout    Middleware // Timeout
	// Transaction runs the transaction: Transaction, or GroupCommit or GroupTransaction, which
	// record the messages themselves and leave Deduplicate empty.
	Transaction Middleware
	// Deduplicate records that the message was applied, in the transaction: Deduplicate, or
	// NaturalIdempotency, Offsets or AckInTransaction.
	Deduplicate Middleware
	// InOrder applies messages in the order of their sequence per key (ordering.InOrder's
	// Middleware).
	InOrder Middleware
}

// AtLeastOnce returns the canonical at-least-once chain of s: every stage but Deduplicate and
// InOrder, which must be nil, around a Transaction, which must not be. Nothing is lost; a
// redelivery after a commit applies the message again.
func AtLeastOnce(s Stages) (Middleware, error) {
	switch {
	case s.Transaction == nil:
		return nil, errors.New("Stages.Transaction: nil (at-least-once processing commits each message's effect before its acknowledgement)")
	case s.Deduplicate != nil:
		return nil, errors.New("Stages.Deduplicate: set (at-least-once processing has no duplicate detection; use ExactlyOnce)")
	case s.InOrder != nil:
		return nil, errors.New("Stages.InOrder: set (use ExactlyOnceInOrder)")
	}
	return s.chain(), nil
}

// ExactlyOnce returns the canonical exactly-once chain of s: every stage but InOrder, which
// must be nil, around a Transaction, which must not be, with Deduplicate inside it (or
// GroupCommit as the Transaction, which records the message ids itself).
func ExactlyOnce(s Stages) (Middleware, error) {
	switch {
	case s.Transaction == nil:
		return nil, errors.New("Stages.Transaction: nil (exactly-once processing records the message id in the transaction of its effect)")
	case s.InOrder != nil:
		return nil, errors.New("Stages.InOrder: set (use ExactlyOnceInOrder)")
	}
	return s.chain(), nil
}

// ExactlyOnceInOrder returns the canonical exactly-once chain of s with per-key order: every
// stage, InOrder innermost, inside the Transaction, which must not be nil, and InOrder must not
// be nil either.
func ExactlyOnceInOrder(s Stages) (Middleware, error) {
	switch {
	case s.Transaction == nil:
		return nil, errors.New("Stages.Transaction: nil (exactly-once processing records the message id in the transaction of its effect)")
	case s.InOrder == nil:
		return nil, errors.New("Stages.InOrder: nil (per-key order needs ordering.InOrder's Middleware)")
	}
	return s.chain(), nil
}

// chain composes the stages that are set, in the canonical order.
func (s Stages) chain() Middleware {
	var set []Middleware
	for _, mw := range []Middleware{s.Tracing, s.Metrics, s.DeadLetter, s.Recover, s.Retry, s.Timeout, s.Transaction, s.Deduplicate, s.InOrder} {
		if mw != nil {
			set = append(set, mw)
		}
	}
	return Chain(set[0], set[1:]...)
}
