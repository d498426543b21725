package ordering

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file gives up on what a stalled key waits for, under the gap policy: it reports a wait
// past the gap timeout, and dead-letters the parked messages of a range or skips it.

// timedOut logs and counts a key whose wait passed the gap timeout, and reports whether it did:
// under Wait it does so once per wait (per value of blocked_since).
func (o *InOrder) timedOut(ctx context.Context, key string, st keyState, cause string, seq int64, detail error, seen map[string]int64) bool {
	if o.cfg.GapPolicy == Wait {
		seen[key] = st.blocked
		if o.alreadyReported(blockedKey{Key: key, Blocked: st.blocked}) {
			return false
		}
	}
	o.timeouts.Add(ctx, 1, metric.WithAttributes(telemetry.AttrHandler.String(o.cfg.Handler),
		AttrGapPolicy.String(o.cfg.GapPolicy.String()), AttrGapCause.String(cause)))
	o.cfg.Logger.Warn("ordering gap timed out", "handler", o.cfg.Handler, "key", key, "seq", seq, "cause", cause,
		"parked", st.parked, "since", time.UnixMicro(st.blocked).UTC(), "policy", o.cfg.GapPolicy.String(), "reason", detail)
	return true
}

// deadLetter carries out p: it publishes the parked messages of key in p's range to the
// dead-letter topic, a page at a time, without holding a transaction, then deletes them (and
// their duplicate-detection records) in a transaction that first checks the key has not moved
// since p was made. With p.skip it records the range as skipped and applies the parked
// messages that follow.
func (o *InOrder) deadLetter(ctx context.Context, next processor.Processor, key string, p *plan, res *SweepResult) error {
	from := p.from
	for from <= p.to {
		page, err := o.store.load(ctx, o.store.db, o.cfg.Handler, key, from-1, drainChunk)
		if err != nil {
			return err
		}
		for len(page) > 0 && page[len(page)-1].Seq > p.to {
			page = page[:len(page)-1]
		}
		if len(page) == 0 {
			return nil
		}
		for _, m := range page {
			md, _ := o.messageData(key, m) // a message whose headers cannot be decoded goes without them
			if err := middleware.PublishDeadLetter(ctx, o.cfg.DeadLetterPublisher, o.cfg.DeadLetterTopic, o.cfg.Handler, md, p.reason); err != nil {
				return err
			}
		}
		done, err := o.removeDeadLettered(ctx, next, key, p, page, res)
		if err != nil || done {
			return err
		}
		from = page[len(page)-1].Seq + 1
	}
	return nil
}

// removeDeadLettered deletes the published page of p, if the key has not moved. done is true
// when nothing more of p is to be done.
func (o *InOrder) removeDeadLettered(ctx context.Context, next processor.Processor, key string, p *plan, page []parkedMsg, res *SweepResult) (done bool, err error) {
	err = sqltx.Run(ctx, o.store.db, func(tx *sqlx.Tx) error {
		var err error
		done, err = o.removeDeadLetteredTx(middleware.WithTx(ctx, tx), tx, next, key, p, page, res)
		return err
	})
	if errors.Is(err, errNothingToDo) {
		return true, nil
	}
	return done, err
}

// removeDeadLetteredTx is the transaction of removeDeadLettered.
func (o *InOrder) removeDeadLetteredTx(ctx context.Context, tx *sqlx.Tx, next processor.Processor, key string, p *plan, page []parkedMsg, res *SweepResult) (done bool, err error) {
	handler := o.cfg.Handler
	st, err := o.store.lockKey(ctx, tx, handler, key)
	if err != nil {
		return false, err
	}
	if st.last != p.last {
		// The key moved: the missing message came, or another sweep acted. What was
		// published stays published; a replay of it is a duplicate by sequence.
		return true, errNothingToDo
	}
	var removed int64
	for _, m := range page {
		deleted, err := o.store.deleteOne(ctx, tx, handler, key, m.Seq, m.MessageID)
		if err != nil {
			return false, err
		}
		if !deleted {
			continue
		}
		removed++
		if o.cfg.Forget != nil {
			md, _ := o.messageData(key, m)
			if err := o.cfg.Forget(ctx, tx, md); err != nil {
				return false, fmt.Errorf("forget the dedup record of message %q: %w", m.MessageID, err)
			}
		}
	}
	res.DeadLettered += int(removed)
	st.parked -= removed
	st.stalled = false
	if p.skip {
		if err := o.store.skip(ctx, tx, handler, key, p.from, p.to, p.reason.Error(), o.now().UnixMicro()); err != nil {
			return false, err
		}
		res.SkippedSequences += p.to - p.from + 1
		st.last = p.to
		if st.parked > 0 {
			before := st.last
			if st, err = o.drain(ctx, tx, next, key, st, true); err != nil {
				return false, err
			}
			res.Applied += st.last - before
		}
	}
	if st.parked <= 0 {
		st.parked, st.blocked, st.stalled = 0, 0, false
	} else if !st.stalled {
		st.blocked = o.now().UnixMicro() // a new wait, for the gap the removal left
	}
	if err := o.store.updateKey(ctx, tx, handler, key, st); err != nil {
		return false, err
	}
	return p.skip, nil
}
