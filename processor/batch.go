package processor

import (
	"context"
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/messagedata"
)

// Batch applies the effects of several messages in one transaction, so that it can write them
// with one multi-row statement.
//
// The router calls a handler's Batch with the new messages of a group (Handler.BatchProcessor):
// messages whose ids were recorded before are answered as duplicates and left out; messages
// that cannot be decoded (JSONBatch) fail alone and are left out. ProcessBatch runs inside the
// group's database transaction (TxFromContext), which also records the ids of msgs; the messages
// are acknowledged only after it commits. What it returns decides each message's fate:
//
//	ProcessBatch returns                     the transaction        each message
//	nil                                      committed              acked, after the commit
//	ErrorFor(msg, err) for some messages     rolled back; the batch those named get err's outcome alone
//	(several joined with errors.Join)        runs again without them (dead letter, retry, nack,
//	                                                                duplicate); the others are acked
//	                                                                once the rerun commits
//	a lost connection, a serialization       rolled back            all retried, then nacked
//	failure or deadlock, a canceled context
//	any other error, or a panic              rolled back; the batch the failing messages are found by
//	                                         is split in halves,    splitting; each gets the error (or
//	                                         each run on its own    the panic) alone; the others are
//	                                                                acked once their half commits
//
// ProcessBatch may therefore run more than once for one message: its database writes commit
// exactly once, and effects outside the transaction must tolerate a repeat. It must not commit
// or roll back the transaction, and must not keep msgs after it returns.
type Batch interface {
	ProcessBatch(ctx context.Context, msgs []*messagedata.MessageData) error
}

// BatchFunc adapts an ordinary function to a Batch.
type BatchFunc func(ctx context.Context, msgs []*messagedata.MessageData) error

// ProcessBatch calls f(ctx, msgs).
func (f BatchFunc) ProcessBatch(ctx context.Context, msgs []*messagedata.MessageData) error {
	return f(ctx, msgs)
}

// MessageError attributes an error of a batch to one of its messages. ErrorFor makes it.
type MessageError struct {
	// Message is the message of the batch that failed.
	Message *messagedata.MessageData
	// Err is its error; it decides the message's outcome as a Processor's error would.
	Err error
}

// ErrorFor reports that msg, one of the messages passed to ProcessBatch, failed with err: the
// batch runs again without it, and err alone decides its outcome (Permanent(err) dead-letters
// it, AlreadyProcessed acks it, any other error is retried and then nacked). Join several with
// errors.Join to name several messages. It returns nil when err is nil.
func ErrorFor(msg *messagedata.MessageData, err error) error {
	if err == nil {
		return nil
	}
	return &MessageError{Message: msg, Err: err}
}

// Error names the message and its error.
func (e *MessageError) Error() string {
	id := "<nil>"
	if e.Message != nil {
		id = fmt.Sprintf("%q", e.Message.ID)
	}
	return fmt.Sprintf("message %s: %v", id, e.Err)
}

// Unwrap returns the message's error.
func (e *MessageError) Unwrap() error { return e.Err }

// MessageErrors returns the MessageErrors in err, found through errors.Join and wrapping, in
// the order they appear; nil when there is none.
func MessageErrors(err error) []*MessageError {
	var out []*MessageError
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) {
		case nil:
			return
		case *MessageError:
			out = append(out, e)
			return
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				walk(inner)
			}
			return
		}
		walk(errors.Unwrap(err))
	}
	walk(err)
	return out
}

// JSONBatch returns a Batch that decodes each message's payload into a T and calls fn with the
// messages and their values, position for position.
//
// A message whose payload is not one JSON value decoding into T fails permanently on its own,
// as with JSON: it is dead-lettered with the decoding error, and fn sees the rest of the batch.
// Fields that T does not declare are ignored.
func JSONBatch[T any](fn func(ctx context.Context, msgs []*messagedata.MessageData, vs []T) error) Batch {
	return BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
		vs := make([]T, 0, len(msgs))
		ok := msgs[:0:0]
		var bad []error
		for _, msg := range msgs {
			var v T
			if err := decodeStrict(msg.Payload, &v); err != nil {
				bad = append(bad, ErrorFor(msg, Permanent(fmt.Errorf("decode JSON payload of message %q into %T: %w", msg.ID, v, err))))
				continue
			}
			ok = append(ok, msg)
			vs = append(vs, v)
		}
		if len(bad) > 0 {
			// The batch runs again without them: fn sees only messages that decode.
			return errors.Join(bad...)
		}
		return fn(ctx, ok, vs)
	})
}
