package groupcommit

import (
	"context"
	"errors"
	"fmt"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file records a group's message ids in its transaction: one statement for the group, and
// a statement per key when the group holds an invalid one.

// record records the ids of set in tx and returns the members to process: the new ones. A
// duplicate gets its result; a later copy of a message in the set waits for the first copy's
// outcome. Without duplicate detection every member is new. refused reports a member beyond
// the retention horizon that the retention policy dead-letters: it has its result, and the
// transaction must not commit the key recorded for it.
func (r *groupRun) record(tx middleware.Tx, set []*slot) (todo []*slot, refused bool, err error) {
	if r.g.positions != nil {
		todo, err = r.lockPositions(tx, set)
		return todo, false, err
	}
	if r.g.store == nil {
		return set, false, nil
	}
	keys := make([]dedup.Key, len(set))
	for i, s := range set {
		keys[i] = s.m.key
	}
	// A try that found an id not new leaves its spans open: the members' one dedup span goes
	// on into the transaction that reads the outcomes.
	ends := r.dedupSpans
	r.dedupSpans = nil
	if ends == nil {
		ends = childSpans(set, telemetry.SpanDedup, 0)
	}
	fresh, err := r.recordKeys(tx, keys, !r.readOutcomes && firstDeliveries(set))
	if err == nil && fresh == nil {
		r.dedupSpans = ends
		return nil, false, errRecordAgain
	}
	if errors.Is(err, dedup.ErrInvalidKey) {
		fresh, err = r.recordOneByOne(tx, keys, set)
	}
	for _, end := range ends {
		end(err)
	}
	if err != nil {
		return nil, false, fmt.Errorf("record %d message ids: %w", len(keys), err)
	}

	todo = make([]*slot, 0, len(set))
	// A later copy of a message in set is never new (Store.RecordMany): only when a member
	// is not new may there be copies to find, by key.
	var firsts map[dedup.Key]*slot
	for i, s := range set {
		if !s.final && !fresh[i].New() {
			firsts = make(map[dedup.Key]*slot, len(set))
			break
		}
	}
	for i, s := range set {
		if s.final { // an invalid key, refused already
			continue
		}
		var first *slot
		repeated := false
		if firsts != nil {
			first, repeated = firsts[s.m.key]
		}
		switch {
		case !repeated:
			if firsts != nil {
				firsts[s.m.key] = s
			}
			if fresh[i].New() {
				reason, err := r.g.cfg.BeyondRetention.Check(s.m.msg, fresh[i], r.g.retention)
				if reason != "" && r.g.cfg.ReportBeyond != nil {
					r.g.cfg.ReportBeyond(s.m.ctx, s.m.msg, reason)
				}
				if err != nil {
					s.finish(memberResult{err: err})
					refused = true
					continue
				}
				todo = append(todo, s)
			} else {
				s.finish(memberResult{err: fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, s.m.msg.ID, r.g.handler)})
				r.send(s) // at once: nothing it waits for
			}
		case first.final: // the first copy is a duplicate
			s.finish(memberResult{err: fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, s.m.msg.ID, r.g.handler)})
			r.send(s)
		default:
			s.first = first // answered with the first copy's outcome
		}
	}
	return todo, refused, nil
}

// errRecordAgain says that the group's ids were recorded by TryRecordKeys and one was not new:
// the transaction must be rolled back and run again with the outcomes read.
var errRecordAgain = errors.New("a message id is not new")

// recordKeys records keys with the store's RecordKeys when it has one, which tells renewed
// expired keys apart, and with RecordMany otherwise. With try, it tries first
// (TryRecordKeys: no round trip of its own on PostgreSQL), and returns nil outcomes when a key
// was not new; the record of a group of first deliveries tries, as they are new but for a
// producer's second publish.
func (r *groupRun) recordKeys(tx middleware.Tx, keys []dedup.Key, try bool) ([]dedup.Outcome, error) {
	if tr, ok := r.g.store.(interface {
		TryRecordKeys(ctx context.Context, tx sqlx.ExtContext, keys []dedup.Key) ([]dedup.Outcome, error)
	}); ok && try {
		return tr.TryRecordKeys(r.ctx, tx, keys)
	}
	if kr, ok := r.g.store.(interface {
		RecordKeys(ctx context.Context, tx sqlx.ExtContext, keys []dedup.Key) ([]dedup.Outcome, error)
	}); ok {
		return kr.RecordKeys(r.ctx, tx, keys)
	}
	fresh, err := r.g.store.RecordMany(r.ctx, tx, keys)
	if err != nil {
		return nil, err
	}
	out := make([]dedup.Outcome, len(fresh))
	for i, f := range fresh {
		if f {
			out[i] = dedup.Recorded
		}
	}
	return out, nil
}

// recordOneByOne records keys one statement each, after RecordMany refused the batch for an
// invalid key: a member whose key is invalid fails permanently (redelivering it cannot change
// its id), the others go on.
func (r *groupRun) recordOneByOne(tx middleware.Tx, keys []dedup.Key, set []*slot) ([]dedup.Outcome, error) {
	fresh := make([]dedup.Outcome, len(keys))
	for i, k := range keys {
		f, err := r.recordKeys(tx, []dedup.Key{k}, false)
		switch {
		case errors.Is(err, dedup.ErrInvalidKey):
			set[i].finish(memberResult{err: processor.Permanent(fmt.Errorf("record message %q: %w", set[i].m.msg.ID, err))})
			r.send(set[i])
		case err != nil:
			return nil, err
		default:
			fresh[i] = f[0]
		}
	}
	return fresh, nil
}

// firstDeliveries reports whether every member of set is delivered for the first time.
func firstDeliveries(set []*slot) bool {
	for _, s := range set {
		if s.m.msg.Delivery > 1 {
			return false
		}
	}
	return true
}
