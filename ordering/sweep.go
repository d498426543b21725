package ordering

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqllock"
	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// Attributes of the onceflow.order.gap_timeouts counter, besides onceflow.handler.
const (
	// AttrGapPolicy is the gap policy that applied: wait, skip or dead-letter.
	AttrGapPolicy = attribute.Key("onceflow.order.gap_policy")
	// AttrGapCause is why the key waited: "gap" (its next message never arrived) or "failure"
	// (its next message is parked and keeps failing).
	AttrGapCause = attribute.Key("onceflow.order.gap_cause")
)

// sweepPage is how many keys one sweeper query lists.
const sweepPage = 500

// SweepResult says what one Sweep did.
type SweepResult struct {
	// Locked is true when another process was sweeping the same handler: nothing was done.
	Locked bool
	// Applied is the number of parked messages applied: retried ones that succeeded, and those
	// released by Skip.
	Applied int64
	// Stalled is the number of keys whose next parked message failed again.
	Stalled int
	// TimedOut is the number of keys whose gap timeout was reported or acted on. Under Wait, a
	// key is reported once per wait.
	TimedOut int
	// SkippedSequences is the number of sequences Skip gave up on.
	SkippedSequences int64
	// DeadLettered is the number of parked messages published to the dead-letter topic.
	DeadLettered int
	// Failed lists the keys whose sweep failed, and why: each was logged and counted
	// (onceflow.order.sweep_errors), and the sweep went on with the other keys. The next sweep
	// tries them again.
	Failed []KeyError
}

// KeyError is the failure of one key in a Sweep.
type KeyError struct {
	Key string
	Err error
}

// Run sweeps every Config.SweepInterval (with jitter) until ctx ends, and returns nil then. It
// logs the errors of a sweep and goes on. Every process may run it: the sweeps of one handler
// take turns through a lock in the database, and the others skip theirs.
func (o *InOrder) Run(ctx context.Context) error {
	for {
		wait := o.cfg.SweepInterval/2 + rand.N(o.cfg.SweepInterval)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		res, err := o.Sweep(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			return nil
		case err != nil:
			o.cfg.Logger.Error("ordering sweep failed", "handler", o.cfg.Handler, "error", err)
		case res.Applied > 0 || res.TimedOut > 0 || res.DeadLettered > 0 || len(res.Failed) > 0:
			o.cfg.Logger.Info("ordering sweep", "handler", o.cfg.Handler, "applied", res.Applied, "stalled", res.Stalled,
				"timed_out", res.TimedOut, "skipped_sequences", res.SkippedSequences, "dead_lettered", res.DeadLettered,
				"failed_keys", len(res.Failed))
		}
	}
}

// Sweep looks once at the handler's keys that need it, each in a transaction of its own:
//
//   - a stalled key (its next message is parked but failed when released): the parked
//     messages are applied again, through the chain Middleware wraps. A message that fails
//     with a permanent error is dead-lettered (when there is a dead-letter publisher), leaving
//     a gap at its sequence;
//   - a key that has waited longer than Config.GapTimeout, for a missing message or for a
//     failing one: the timeout is logged and counted (onceflow.order.gap_timeouts), and
//     Config.GapPolicy applies.
//
// Messages to dead-letter are read, published, and only then deleted in a transaction that
// checks the key has not moved meanwhile: no database lock is held while publishing, and a
// message is never deleted before the broker has it. A crash in between publishes it twice;
// its replay is then a duplicate by sequence.
//
// Each key is swept on its own: a key whose sweep fails (a parked message that cannot be
// dead-lettered, say) is logged at ERROR, counted in onceflow.order.sweep_errors and listed in
// SweepResult.Failed, and the sweep goes on with the other keys, whose gap timeouts still fire.
// Sweep returns an error only when it cannot list the keys, or ctx ends.
//
// One process sweeps a handler at a time (a PostgreSQL advisory lock, a MySQL named lock, a
// lock file beside an SQLite database): when another holds the lock, Sweep returns at once
// with Locked set. It fails when Middleware has not wrapped a processor yet.
func (o *InOrder) Sweep(ctx context.Context) (res SweepResult, err error) {
	nextp := o.next.Load()
	if nextp == nil {
		return res, errors.New("ordering: Sweep: the interceptor wraps no processor yet (apply Middleware first)")
	}
	next := *nextp
	release, held, err := sqllock.TryLock(ctx, o.store.db, o.lockName())
	if err != nil {
		return res, fmt.Errorf("ordering: sweep handler %q: take the sweep lock: %w", o.cfg.Handler, err)
	}
	if !held {
		return SweepResult{Locked: true}, nil
	}
	defer func() {
		if rerr := release(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("ordering: sweep handler %q: %w", o.cfg.Handler, rerr))
		}
	}()

	cutoff := o.now().Add(-o.cfg.GapTimeout).UnixMicro()
	seen := map[string]int64{}
	defer func() {
		o.mu.Lock()
		o.reported = seen
		o.mu.Unlock()
	}()
	failed := map[string]bool{}
	sweep := func(k blockedKey) error {
		if failed[k.Key] {
			return nil // once per pass
		}
		for {
			more, err := o.sweepKey(ctx, next, k.Key, cutoff, &res, seen)
			switch {
			case err != nil && ctx.Err() != nil:
				return err
			case err != nil:
				failed[k.Key] = true
				o.keyFailed(ctx, k.Key, err, &res)
				return nil
			case !more:
				return nil
			}
		}
	}
	if err := o.eachKey(ctx, o.store.q.stalledKeys, nil, sweep); err != nil {
		return res, err
	}
	err = o.eachKey(ctx, o.store.q.overdueKeys, []any{cutoff}, func(k blockedKey) error {
		if o.cfg.GapPolicy == Wait && o.alreadyReported(k) {
			seen[k.Key] = k.Blocked
			return nil
		}
		return sweep(k)
	})
	return res, err
}

// keyFailed records that the sweep of key failed with err, and lets the sweep go on.
func (o *InOrder) keyFailed(ctx context.Context, key string, err error, res *SweepResult) {
	res.Failed = append(res.Failed, KeyError{Key: key, Err: err})
	o.sweepErrors.Add(ctx, 1, metric.WithAttributes(telemetry.AttrHandler.String(o.cfg.Handler)))
	o.cfg.Logger.Error("ordering sweep of a key failed; the other keys go on, this one is tried again at the next sweep",
		"handler", o.cfg.Handler, "key", key, "error", err)
}

// lockName names the sweep lock of the handler: the table and a hash of the handler name, which
// may hold any character.
func (o *InOrder) lockName() string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(o.cfg.Handler))
	return fmt.Sprintf("%s.sweep.%016x", o.store.table, h.Sum64())
}

func (o *InOrder) alreadyReported(k blockedKey) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	prev, ok := o.reported[k.Key]
	return ok && prev == k.Blocked
}

// eachKey runs fn for every key that a paged key query lists, page by page in key order.
func (o *InOrder) eachKey(ctx context.Context, query string, args []any, fn func(blockedKey) error) error {
	after := ""
	for {
		page, err := o.store.blockedKeys(ctx, query, append(append([]any{o.cfg.Handler}, args...), after, sweepPage)...)
		if err != nil {
			return fmt.Errorf("ordering: sweep handler %q: list keys: %w", o.cfg.Handler, err)
		}
		for _, k := range page {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := fn(k); err != nil {
				return fmt.Errorf("ordering: sweep handler %q: key %s: %w", o.cfg.Handler, textcol.Quote(k.Key), err)
			}
			after = k.Key
		}
		if len(page) < sweepPage {
			return nil
		}
	}
}

// plan is a range of parked messages of one key to dead-letter, decided in a transaction and
// carried out after it.
type plan struct {
	last     int64 // the key's last applied sequence when the plan was made
	from, to int64
	reason   error
	skip     bool // record from..to as skipped and advance past it once dead-lettered
}

// sweepKey handles one key in a transaction of its own. more is true when MaxDrain stopped a
// release of parked messages: the caller runs it again.
func (o *InOrder) sweepKey(ctx context.Context, next processor.Processor, key string, cutoff int64, res *SweepResult, seen map[string]int64) (more bool, err error) {
	var p *plan
	err = sqltx.Run(ctx, o.store.db, func(tx *sqlx.Tx) error {
		var err error
		more, p, err = o.sweepKeyTx(middleware.WithTx(ctx, tx), tx, next, key, cutoff, res, seen)
		return err
	})
	switch {
	case errors.Is(err, errNothingToDo):
		return false, nil
	case err != nil:
		return false, err
	case p == nil:
		return more, nil
	}
	return false, o.deadLetter(ctx, next, key, p, res)
}

// errNothingToDo ends a key's transaction without a commit: there was nothing to change.
var errNothingToDo = errors.New("nothing to do")

// sweepKeyTx is the transaction of sweepKey; p is the dead letter to publish after its commit.
func (o *InOrder) sweepKeyTx(ctx context.Context, tx *sqlx.Tx, next processor.Processor, key string, cutoff int64, res *SweepResult, seen map[string]int64) (more bool, p *plan, err error) {
	handler := o.cfg.Handler
	st, err := o.store.lockKey(ctx, tx, handler, key)
	if err != nil {
		return false, nil, err
	}
	if st.parked == 0 {
		return false, nil, errNothingToDo
	}
	lowest, err := o.store.load(ctx, tx, handler, key, st.last, 1)
	if err != nil {
		return false, nil, err
	}
	if len(lowest) == 0 {
		// The count says there are parked messages and there are none: repair it.
		st.parked, st.blocked, st.stalled = 0, 0, false
		if err := o.store.updateKey(ctx, tx, handler, key, st); err != nil {
			return false, nil, err
		}
		return false, nil, nil
	}

	waited := func() time.Duration { return o.now().Sub(time.UnixMicro(st.blocked)).Round(time.Second) }
	if lowest[0].Seq == st.last+1 {
		// Stalled: apply the parked messages again.
		before := st.last
		var failed *failure
		st, failed, more, err = o.drainFailing(ctx, tx, next, key, st, false)
		if err != nil {
			return false, nil, err
		}
		res.Applied += st.last - before
		if failed != nil {
			res.Stalled++
			seq := failed.msg.Seq
			switch {
			case processor.IsPermanent(failed.err) && o.cfg.DeadLetterPublisher != nil:
				p = &plan{last: st.last, from: seq, to: seq,
					reason: fmt.Errorf("parked sequence %d of key %s failed permanently: %w", seq, textcol.Quote(key), failed.err)}
			case st.blocked <= cutoff:
				cause := fmt.Errorf("sequence %d of key %s failed for %s (%d attempts): %w", seq, textcol.Quote(key), waited(), failed.msg.Attempts+1, failed.err)
				if o.timedOut(ctx, key, st, "failure", seq, cause, seen) {
					res.TimedOut++
				}
				switch o.cfg.GapPolicy {
				case Skip:
					p = &plan{last: st.last, from: seq, to: seq, skip: true, reason: fmt.Errorf("%w; skipped (gap policy skip)", cause)}
				case DeadLetter:
					p = &plan{last: st.last, from: seq, to: MaxSequence, reason: fmt.Errorf("%w (gap policy dead-letter)", cause)}
				}
			}
		}
	} else {
		// A gap before the lowest parked message.
		if st.blocked > cutoff {
			return false, nil, errNothingToDo // it moved since it was listed
		}
		gapAt := st.last + 1
		cause := fmt.Errorf("gap at seq %d of key %s not filled after %s", gapAt, textcol.Quote(key), waited())
		if o.timedOut(ctx, key, st, "gap", gapAt, cause, seen) {
			res.TimedOut++
		}
		switch o.cfg.GapPolicy {
		case Wait:
			return false, nil, errNothingToDo
		case Skip:
			to := lowest[0].Seq - 1
			if err := o.store.skip(ctx, tx, handler, key, gapAt, to, cause.Error()+" (gap policy skip)", o.now().UnixMicro()); err != nil {
				return false, nil, err
			}
			res.SkippedSequences += to - gapAt + 1
			st.last = to
			before := st.last
			if st, _, more, err = o.drainFailing(ctx, tx, next, key, st, true); err != nil {
				return false, nil, err
			}
			res.Applied += st.last - before
		case DeadLetter:
			p = &plan{last: st.last, from: lowest[0].Seq, to: MaxSequence, reason: cause}
		}
	}
	if err := o.store.updateKey(ctx, tx, handler, key, st); err != nil {
		return false, nil, err
	}
	return more, p, nil
}
