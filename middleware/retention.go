package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// ErrBeyondRetention reports a message delivered beyond the retention of its duplicate-detection
// keys, which its handler's RetentionPolicy dead-letters instead of processing.
var ErrBeyondRetention = errors.New("delivered beyond the dedup retention")

// Reasons a message is beyond the retention horizon, given to the reporting function of
// WithRetentionPolicy.
const (
	// BeyondExpiredKey: the message's key was recorded, and has expired, and the expired
	// record was still in the table: the message was certainly processed before.
	BeyondExpiredKey = "expired_key"
	// BeyondOldMessage: the message's timestamp is older than the retention, so a record of
	// an earlier delivery may have been purged already.
	BeyondOldMessage = "old_message"
)

// RetentionPolicy says what Deduplicate and GroupCommit do with a message delivered beyond the
// retention horizon of their store: every such message is reported (WithRetentionPolicy) and
// then processed or dead-lettered.
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

func (p RetentionPolicy) refuses(reason string) bool {
	return p == DeadLetterBeyondRetention || (p == DeadLetterExpiredKeys && reason == BeyondExpiredKey)
}

// WithRetentionPolicy sets the RetentionPolicy of Deduplicate or GroupCommit and report, called
// for each message delivered beyond the retention horizon with the reason (BeyondExpiredKey or
// BeyondOldMessage) before the policy applies; report may be nil. The router counts these in
// onceflow.dedup.beyond_retention and logs them.
func WithRetentionPolicy(p RetentionPolicy, report func(ctx context.Context, msg *messagedata.MessageData, reason string)) DedupOption {
	return dedupOptionFunc(func(c *dedupConfig) {
		c.retention = p
		c.reportBeyond = report
	})
}

// keyRecorder is a store that says whether a new key replaced an expired record;
// *dedup.SQLStore is one.
type keyRecorder interface {
	RecordKey(ctx context.Context, tx sqlx.ExtContext, key dedup.Key, internalID string) (dedup.Outcome, error)
}

// keysRecorder is a GroupStore that says whether each new key replaced an expired record;
// *dedup.SQLStore is one.
type keysRecorder interface {
	RecordKeys(ctx context.Context, tx sqlx.ExtContext, keys []dedup.Key) ([]dedup.Outcome, error)
}

// retentionOf returns the retention of store, when it says.
func retentionOf(store any) time.Duration {
	if s, ok := store.(interface{ Retention() time.Duration }); ok {
		return s.Retention()
	}
	return 0
}

// beyond returns why msg, newly recorded with outcome o, is beyond the retention of a store
// that keeps keys for retention, or "" when it is not.
func beyond(msg *messagedata.MessageData, o dedup.Outcome, retention time.Duration) string {
	switch {
	case o == dedup.Renewed:
		return BeyondExpiredKey
	case retention > 0 && !msg.Timestamp.IsZero() && time.Since(msg.Timestamp) > retention:
		return BeyondOldMessage
	}
	return ""
}

// validate reports an invalid option value.
func (c *dedupConfig) validate() error {
	if !c.retention.Valid() {
		return fmt.Errorf("WithRetentionPolicy: %d is not a RetentionPolicy", c.retention)
	}
	return nil
}

// checkRetention reports msg when it is beyond the retention, and returns the permanent error
// that dead-letters it when the policy says so.
func (c *dedupConfig) checkRetention(ctx context.Context, msg *messagedata.MessageData, o dedup.Outcome, retention time.Duration) error {
	reason := beyond(msg, o, retention)
	if reason == "" {
		return nil
	}
	if c.reportBeyond != nil {
		c.reportBeyond(ctx, msg, reason)
	}
	if !c.retention.refuses(reason) {
		return nil
	}
	what := "its expired key is still recorded: it was processed before"
	if reason == BeyondOldMessage {
		what = fmt.Sprintf("it is older than the retention of %s", retention)
	}
	return processor.Permanent(fmt.Errorf("message %q %w (%s): %s", msg.ID, ErrBeyondRetention, reason, what))
}
