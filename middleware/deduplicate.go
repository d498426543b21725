package middleware

import (
	"context"
	"errors"
	"fmt"

	"github.com/oklog/ulid/v2"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// errOutsideTransaction is the error of a middleware that runs outside Transaction.
var errOutsideTransaction = fmt.Errorf("%w: place this middleware inside Transaction", ErrNoTransaction)

// DedupOption configures Deduplicate, and the duplicate detection of GroupCommit.
type DedupOption interface {
	applyDedup(*dedupConfig)
	GroupOption
}

type dedupOptionFunc func(*dedupConfig)

func (f dedupOptionFunc) applyDedup(c *dedupConfig) { f(c) }

func (f dedupOptionFunc) applyGroup(c *groupConfig) {
	f(&c.dedup)
	c.dedupOptions = true
}

type dedupConfig struct {
	withTimestamp bool
	checkFirst    bool
	retention     RetentionPolicy
	reportBeyond  func(ctx context.Context, msg *messagedata.MessageData, reason string)
}

// WithTimestampKey makes the message timestamp part of the key, as a classic message_log table
// does with the JMS timestamp: ids that a producer reuses over time stay distinct.
func WithTimestampKey() DedupOption {
	return dedupOptionFunc(func(c *dedupConfig) { c.withTimestamp = true })
}

// CheckFirst selects the check-first mode of an id mapper: the store is read before anything is written,
// so a redelivered message costs one read and no write lock; a new message gets a minted
// internal, time-ordered id (processor.InternalID) recorded with the key as the id mapping.
// The expiry of the mapping is the store's retention. Concurrent copies are still caught by the
// insert that follows the check.
func CheckFirst() DedupOption { return dedupOptionFunc(func(c *dedupConfig) { c.checkFirst = true }) }

// Deduplicate records the message id for handler in store, inside the transaction, before
// calling next; a message whose id is already recorded is not processed again.
//
// It must run inside Transaction: the record commits with the processor's writes, or rolls back
// with them, so a failed attempt leaves no record and its redelivery is processed. For a
// duplicate it returns an error wrapping processor.ErrDuplicate (the router acks). A message
// without an id is refused with a permanent error wrapping messagedata.ErrNoMessageID, so it is
// dead-lettered instead of processed under an empty key.
//
// Two copies of one message processed at the same time by two consumers give one effect: the
// second insert of the key waits for the first transaction, then finds the key and reports a
// duplicate.
//
// A message delivered beyond the store's retention (its expired key still recorded, or its
// timestamp older than the retention) is reported and handled by the RetentionPolicy
// (WithRetentionPolicy): by default dead-lettered when its expired key is still recorded.
//
// It fails, naming the argument or the option, when store is nil or an option's value is
// invalid.
func Deduplicate(store dedup.Store, handler string, opts ...DedupOption) (Middleware, error) {
	var cfg dedupConfig
	for _, o := range opts {
		o.applyDedup(&cfg)
	}
	if store == nil {
		return nil, errors.New("Deduplicate: the store is nil")
	}
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("Deduplicate: %w", err)
	}
	retention := retentionOf(store)
	recorder, renewals := store.(keyRecorder)
	return func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if msg.ID == "" {
				return processor.Permanent(messagedata.ErrNoMessageID)
			}
			tx, ok := CurrentTx(ctx)
			if !ok {
				return errOutsideTransaction
			}
			key := dedup.Key{Handler: handler, MessageID: msg.ID}
			if cfg.withTimestamp && !msg.Timestamp.IsZero() {
				key.Timestamp = msg.Timestamp.UnixMicro()
			}

			dctx, end := telemetry.Child(ctx, telemetry.SpanDedup)
			internalID := ""
			if cfg.checkFirst {
				existing, found, err := store.Lookup(dctx, tx, key)
				if err != nil {
					end(err)
					return invalidKeyIsPermanent(fmt.Errorf("look up message %q: %w", msg.ID, err))
				}
				if found {
					end(nil)
					return fmt.Errorf("%w: id %q is mapped to %q", processor.ErrDuplicate, msg.ID, existing)
				}
				// Monotonic within a millisecond as well: ids minted by one process sort in
				// the order they were minted.
				internalID = ulid.Make().String()
			}
			var outcome dedup.Outcome
			var err error
			if renewals {
				outcome, err = recorder.RecordKey(dctx, tx, key, internalID)
			} else {
				var fresh bool
				fresh, err = store.Record(dctx, tx, key, internalID)
				if fresh {
					outcome = dedup.Recorded
				}
			}
			end(err)
			if err != nil {
				return invalidKeyIsPermanent(fmt.Errorf("record message %q: %w", msg.ID, err))
			}
			if !outcome.New() {
				return fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, msg.ID, handler)
			}
			if err := cfg.checkRetention(ctx, msg, outcome, retention); err != nil {
				return err // the transaction rolls back: the expired record stays as it was
			}
			if cfg.checkFirst {
				ctx = WithInternalID(ctx, internalID)
			}
			return next.Process(ctx, msg)
		})
	}, nil
}

// invalidKeyIsPermanent marks an id the store cannot hold (too long, not UTF-8) as permanent:
// redelivering the message cannot change its id.
func invalidKeyIsPermanent(err error) error {
	if errors.Is(err, dedup.ErrInvalidKey) {
		return processor.Permanent(err)
	}
	return err
}
