package dedup

import (
	"errors"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// ErrBeyondRetention reports a message delivered beyond the retention of its duplicate-detection
// keys, which its handler's RetentionPolicy dead-letters instead of processing.
var ErrBeyondRetention = errors.New("delivered beyond the dedup retention")

// Reasons a message is beyond the retention horizon, which RetentionPolicy.Check returns.
const (
	// BeyondExpiredKey: the message's key was recorded, and has expired, and the expired
	// record was still in the table: the message was certainly processed before.
	BeyondExpiredKey = "expired_key"
	// BeyondOldMessage: the message's timestamp is older than the retention, so a record of
	// an earlier delivery may have been purged already.
	BeyondOldMessage = "old_message"
)

// RetentionPolicy says what duplicate detection does with a message delivered beyond the
// retention horizon of its store: every such message is reported (the router counts it in
// onceflow.dedup.beyond_retention and logs it) and then processed or dead-lettered.
type RetentionPolicy int

// The retention policies.
const (
	// DeadLetterExpiredKeys dead-letters a message whose expired key was still recorded (a
	// certain duplicate, which processing would apply twice) and processes one that is only
	// older than the retention. The default.
	DeadLetterExpiredKeys RetentionPolicy = iota
	// ProcessBeyondRetention processes both: the expired key is recorded again.
	ProcessBeyondRetention
	// DeadLetterBeyondRetention dead-letters both, for an operator to inspect.
	DeadLetterBeyondRetention
)

// String names p.
func (p RetentionPolicy) String() string {
	switch p {
	case DeadLetterExpiredKeys:
		return "DeadLetterExpiredKeys"
	case ProcessBeyondRetention:
		return "ProcessBeyondRetention"
	case DeadLetterBeyondRetention:
		return "DeadLetterBeyondRetention"
	}
	return fmt.Sprintf("RetentionPolicy(%d)", int(p))
}

// Valid reports whether p is one of the policies.
func (p RetentionPolicy) Valid() bool {
	return p >= DeadLetterExpiredKeys && p <= DeadLetterBeyondRetention
}

// Check returns why msg, newly recorded with outcome o in a store that keeps keys for
// retention (0: unknown), is beyond the retention (BeyondExpiredKey or BeyondOldMessage), or ""
// when it is not; and the permanent error that dead-letters it when p says so, nil when p
// processes it.
func (p RetentionPolicy) Check(msg *messagedata.MessageData, o Outcome, retention time.Duration) (reason string, err error) {
	switch {
	case o == Renewed:
		reason = BeyondExpiredKey
	case retention > 0 && !msg.Timestamp.IsZero() && time.Since(msg.Timestamp) > retention:
		reason = BeyondOldMessage
	default:
		return "", nil
	}
	if p != DeadLetterBeyondRetention && (p != DeadLetterExpiredKeys || reason != BeyondExpiredKey) {
		return reason, nil
	}
	what := "its expired key is still recorded: it was processed before"
	if reason == BeyondOldMessage {
		what = fmt.Sprintf("it is older than the retention of %s", retention)
	}
	return reason, processor.Permanent(fmt.Errorf("message %q %w (%s): %s", msg.ID, ErrBeyondRetention, reason, what))
}
