package onceflow

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/sqldb"
)

// This file holds the delivery limit's bookkeeping: the durable count of a message's deliveries
// and attempts where the broker does not count them, and its dead letters.

// deliveries returns the delivery count of msg: the broker's, when it counts; 1 for a
// delivery the broker says is the first; otherwise the durable count of the handler's counter
// (0 when the handler has none, or it cannot be read). It returns the counter's error when it
// is an outage (sqldb.IsOutage): the delivery is given back, uncounted.
func (c *consumer) deliveries(ctx context.Context, msg *message.Message, md *messagedata.MessageData) (int, error) {
	info, known := redelivery.FromContext(msg.Context())
	switch {
	case known && info.Count > 0:
		return info.Count, nil
	case known && !info.Redelivered:
		return 1, nil
	case c.counter == nil || md.ID == "":
		return 0, nil
	}
	initial := 1 // every delivery is counted here
	if known {
		initial = 2 // the first went uncounted: the broker said it was the first
	}
	n, err := c.counter.Count(ctx, c.name, counterID(md), initial)
	if err != nil {
		if sqldb.IsOutage(err) {
			return 0, fmt.Errorf("count the delivery: %w", err)
		}
		c.logger.Warn("cannot count the delivery; the delivery limit does not apply to it", "message_id", md.ID, "error", err)
		return 0, nil
	}
	return n, nil
}

// held is how a delivery holds the handler's isolation lock.
type held int

const (
	heldNone   held = iota // the handler has no counter: no lock
	heldShared             // the read lock, shared with the other deliveries
	heldAlone              // the lock, alone
)

// isolate takes the handler's isolation lock for a delivery: shared for a first delivery and
// for a message's first redelivery, alone for its later ones, when the handler counts
// attempts; none without a counter. It records a redelivery before its processing begins: the
// first as run with others (dedup.Counter.Grouped), whose attempt counts only if it is nacked
// (delivery.State.AttemptOnNack), the later ones as attempts (dedup.Counter.Attempt). It
// returns how it holds the lock (a function to release it would be an allocation per
// delivery), and the error of a record when it is an outage: the delivery is then given back
// unprocessed.
//
// A consumer's death sends back every message it held: their first redeliveries run in groups
// as their first deliveries did, not one at a time. A message that kills its consumer kills it
// again there, and runs alone from then on, where its deaths count.
func (c *consumer) isolate(ctx context.Context, md *messagedata.MessageData, st *delivery.State) (held, error) {
	switch {
	case c.counter == nil || c.shared:
		return heldNone, nil
	case md.Delivery-st.Uncounted <= 1 || md.ID == "":
		// A first delivery, or one whose earlier deliveries were all given back during
		// outages: none of them can have killed its consumer.
		c.isolation.RLock()
		return heldShared, nil
	}
	// The record, not the delivery count, tells the first redelivery: a count may repeat
	// (Kafka's, when a member dies before it records a hand-out).
	grouped, err := c.counter.Grouped(ctx, c.name, counterID(md))
	switch {
	case err != nil && sqldb.IsOutage(err):
		return heldNone, fmt.Errorf("record the redelivery: %w", err)
	case err == nil && grouped == 1:
		// The first delivery is taken to have begun, as is this one until it ends without an
		// outcome.
		st.Attempts, st.AttemptOnNack = 2, true
		c.isolation.RLock()
		return heldShared, nil
	case err == nil:
		st.Known = grouped + 1 // the first delivery, the one run with others, and those alone
	}
	c.isolation.Lock()
	n, err := c.counter.Attempt(ctx, c.name, counterID(md))
	if err != nil && sqldb.IsOutage(err) {
		return heldAlone, fmt.Errorf("record the attempt: %w", err)
	}
	if err != nil {
		// The delivery count includes deliveries that never began (they waited behind a
		// message that killed their consumer): on it alone, a message would be given up for
		// deliveries it never had. Its processing needs the database that just failed anyway.
		c.logger.Warn("cannot record the attempt; the delivery limit does not apply to this delivery", "message_id", md.ID, "error", err)
		st.AttemptUnrecorded = true
	} else {
		// The first delivery is not recorded: it is taken to have begun. The one run with
		// others is recorded if it failed; if it ended without an outcome, it is not taken
		// to have begun.
		st.Attempts = n + 1
	}
	return heldAlone, nil
}

// recordGrouped records the attempt of a message's first redelivery, which ran with others
// unrecorded (delivery.State.AttemptOnNack), as it is nacked: it began, and ended with an
// outcome that brings it back (a failure, a panic, a lost acknowledgement), so its later
// deliveries count it. One whose delivery ended first (its consumer stopped) is not counted.
// A record that cannot be written only moves the limit a delivery later.
func (c *consumer) recordGrouped(ctx context.Context, msg *message.Message, md *messagedata.MessageData) {
	if msg.Context().Err() != nil || md.ID == "" {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	if _, err := c.counter.Attempt(rctx, c.name, counterID(md)); err != nil {
		c.logger.Warn("cannot record the attempt; the delivery limit counts it a delivery later", "message_id", md.ID, "error", err)
	}
}

// recordTimeout bounds a record the router writes after a delivery's processing, whose context
// may have ended.
const recordTimeout = 10 * time.Second

// counterID is the id under which the delivery counter keeps md: its id, and for a replayed
// dead letter (messagedata.HeaderReplayCount) its replay count too, so that a replay starts
// with no deliveries, attempts or dead letter of the message before it.
func counterID(md *messagedata.MessageData) string {
	if n := md.Header(messagedata.HeaderReplayCount); n != "" {
		return md.ID + "#replay-" + n
	}
	return md.ID
}

// records returns the records that the router keeps for the built-in stages of the handler of
// env (delivery.Records), or nil for a BestEffort handler, whose messages are acknowledged on
// receipt: its dead letters and processed redeliveries in the delivery counter of its
// database, whether a message over its delivery limit was processed (from its dedup store when
// it has one), and the report of a message delivered beyond the dedup retention.
func (r *Router) records(env *stageEnv) (*delivery.Records, error) {
	h := env.Handler
	if h.qos() == BestEffort {
		return nil, nil
	}
	counter, err := r.counterFor(h)
	if err != nil {
		return nil, err
	}
	rec := deadLetterRecord{counter: counter, handler: h.Name}
	out := &delivery.Records{DeadLettered: rec.DeadLettered, MarkDeadLettered: rec.MarkDeadLettered, BeyondRetention: r.beyondRetention(env)}
	switch store := env.Dedup; {
	case h.DeadLetter.MaxDeliveries < 0:
	case store != nil:
		out.Processed = func(ctx context.Context, msg *messagedata.MessageData) (bool, error) {
			_, found, err := store.Lookup(ctx, h.DB, dedup.KeyOf(h.Name, msg, h.Dedup.WithTimestamp))
			return found, err
		}
	default:
		// No duplicate detection to ask whether a message over the limit was processed: the
		// counter remembers the redeliveries that were.
		out.Processed, out.MarkProcessed = rec.Processed, rec.MarkProcessed
	}
	return out, nil
}

// deadLetterRecord keeps a handler's dead letters in its delivery counter.
type deadLetterRecord struct {
	counter *dedup.Counter
	handler string
}

func (r deadLetterRecord) DeadLettered(ctx context.Context, md *messagedata.MessageData) (bool, error) {
	if md.ID == "" {
		return false, nil
	}
	return r.counter.DeadLettered(ctx, r.handler, counterID(md))
}

func (r deadLetterRecord) MarkDeadLettered(ctx context.Context, md *messagedata.MessageData) error {
	if md.ID == "" {
		return nil // dead-lettered under a fresh id: no redelivery can be told from another message
	}
	return r.counter.MarkDeadLettered(ctx, r.handler, counterID(md))
}

// Processed reports whether a redelivery of md was processed (MarkProcessed), for a handler
// without duplicate detection.
func (r deadLetterRecord) Processed(ctx context.Context, md *messagedata.MessageData) (bool, error) {
	if md.ID == "" {
		return false, nil
	}
	return r.counter.Processed(ctx, r.handler, counterID(md))
}

// MarkProcessed records that a redelivery of md was processed and committed.
func (r deadLetterRecord) MarkProcessed(ctx context.Context, md *messagedata.MessageData) error {
	if md.ID == "" {
		return nil
	}
	return r.counter.MarkProcessed(ctx, r.handler, counterID(md))
}
