package processor

import (
	"database/sql"
	"errors"
	"fmt"
)

// ErrDuplicate reports that the message was already processed. The transaction is rolled back
// and the message is acknowledged without its effect being applied again.
//
// The Deduplicate middleware returns it for a message id it has already recorded; a processor
// returns it (usually through AlreadyProcessed) when its own writes show that the message was
// applied before, the "natural idempotency" of a unique key or a version check.
var ErrDuplicate = errors.New("message already processed")

// AlreadyProcessed returns an error that reports the message as a duplicate, with reason
// explaining how that was recognised. errors.Is(err, ErrDuplicate) holds for the result.
func AlreadyProcessed(reason string) error {
	return fmt.Errorf("%w: %s", ErrDuplicate, reason)
}

// IsDuplicate reports whether err says the message was already processed.
func IsDuplicate(err error) bool { return errors.Is(err, ErrDuplicate) }

// RowsAffectedOrDuplicate turns the result of a guarded INSERT into a natural-idempotency
// outcome: an INSERT ... ON CONFLICT DO NOTHING keyed by the message's own business key that
// touches zero rows means the message was applied before. It returns err when err is not nil,
// AlreadyProcessed when no row was touched, and nil otherwise.
//
// Use it only where zero rows can mean nothing else. An UPDATE guarded by a version touches
// zero rows both when the message was applied before and when it arrived before its
// predecessor; use CheckVersion for it, which tells the two apart.
func RowsAffectedOrDuplicate(res sql.Result, err error) error {
	if err != nil {
		return err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("read rows affected: %w", err)
	}
	if n == 0 {
		return AlreadyProcessed("the guarded statement touched no row")
	}
	return nil
}

// PermanentError is an error that retrying will not cure: a malformed payload, a message that
// violates a business rule. The message goes to the dead-letter topic with the error as its
// reason, and is acknowledged.
type PermanentError struct {
	Err error
}

// Permanent marks err as permanent. It returns nil when err is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// Error returns the message of the wrapped error.
func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// IsPermanent reports whether err, or an error it wraps, was made by Permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// PanicError is what the Recover middleware returns for a processor that panicked. The
// transaction has been rolled back; the message is nacked.
type PanicError struct {
	// Value is the value passed to panic.
	Value any
	// Stack is the stack of the panicking goroutine.
	Stack []byte
}

// Error describes the panic value.
func (e *PanicError) Error() string { return fmt.Sprintf("processor panicked: %v", e.Value) }

// Unwrap returns the panic value when it is an error.
func (e *PanicError) Unwrap() error {
	if err, ok := e.Value.(error); ok {
		return err
	}
	return nil
}

// IsPanic reports whether err, or an error it wraps, reports a recovered panic.
func IsPanic(err error) bool {
	var p *PanicError
	return errors.As(err, &p)
}

// ErrDeadLettered reports that the message was published to the dead-letter topic. The router
// acknowledges a message whose chain returns an error wrapping it.
var ErrDeadLettered = errors.New("message dead-lettered")

// IsDeadLettered reports whether err says the message went to the dead-letter topic.
func IsDeadLettered(err error) bool { return errors.Is(err, ErrDeadLettered) }

// ErrPredecessorMissing reports a message that arrived before the one it follows: its version
// is ahead of the stored one by more than one. It is retryable: the message is redelivered
// after a delay, by when its predecessor may have been applied.
var ErrPredecessorMissing = errors.New("the message's predecessor has not been applied yet")

// CheckVersion gives the outcome of a version-checked UPDATE (... SET version = v WHERE
// version = v - 1) that touched no row, from the version read after it and the version v the
// message writes. It never returns nil: the message was not applied. AlreadyProcessed when
// stored >= v (this message, or a later one, was applied); otherwise an error wrapping
// ErrPredecessorMissing, which is retried and redelivered rather than dropped: stored < v-1 means
// the message is early; stored == v-1 means its predecessor committed between the UPDATE and
// the read, and the message applies when it runs again.
func CheckVersion(stored, v int64) error {
	if stored >= v {
		return AlreadyProcessed(fmt.Sprintf("stored version %d is at or past the message's %d", stored, v))
	}
	return fmt.Errorf("%w: the message writes version %d, the stored version was %d when it ran", ErrPredecessorMissing, v, stored)
}
