package groupcommit

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/internal/crashpoint"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// This file runs one group of GroupCommit, GroupTransaction or GroupOffsets: its
// transactions, the reruns without the members that fail, and each member's result
// (grouprecord.go records the group's ids, groupbatch.go calls a batch processor).

// slot is one member's part in a running group.
type slot struct {
	m     *member
	first *slot // the first copy of the same message in the transaction, for a later copy
	ok    bool  // processed successfully in the current transaction, waiting for its commit
	final bool  // res is its result
	res   memberResult
	sent  bool
	carry bool // GroupOffsets: joins the next group instead of taking a result
}

// finish gives s its result.
func (s *slot) finish(res memberResult) {
	s.ok = false
	s.final = true
	s.res = res
}

// groupRun is one group: its members and the transactions it takes to settle them.
type groupRun struct {
	g     *grouper
	size  int
	slots []slot
	ctx   context.Context // the group's context: ends when every member's context has ended
	// joined are the members that joined by Join, whose results are set: the caller of run
	// notifies them (notifyJoined).
	joined []*member
	// readOutcomes is set once a try to record the group's ids found one that was not new:
	// the group's later transactions read the outcome of each.
	readOutcomes bool
	// dedupSpans are the members' dedup spans of a try that found an id not new, ended by the
	// record that reads the outcomes.
	dedupSpans []func(error)
}

// run runs the group of members and hands every member its result: it sends each member that
// waits in a goroutine its result, and returns the members that joined by Join, with their
// results, for the caller to notify once the group's transaction is free for the next group.
func (g *grouper) run(members []*member) (joined []*member) {
	r := &groupRun{g: g, slots: make([]slot, 0, len(members))}
	for _, m := range members {
		if m.claim() { // the others have left
			r.slots = append(r.slots, slot{m: m})
		}
	}
	if len(r.slots) == 0 {
		return
	}
	r.size = len(r.slots)
	if g.positions != nil {
		inPartitionOrder(r.slots)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	// One goroutine waits for the members' contexts in turn, and ends the group's once the
	// last has ended; it stops with the group. It asks a member's context for its Done channel,
	// which makes one, only once those before it have ended: while no member's context ends,
	// that is the first member's alone.
	ends := make([]context.Context, len(r.slots))
	for i := range r.slots {
		ends[i] = r.slots[i].m.ctx
	}
	go func() {
		for _, end := range ends {
			if end.Err() != nil {
				continue
			}
			select {
			case <-end.Done():
			case <-ctx.Done():
				return
			}
		}
		cancel(errors.New("the context of every member has ended"))
	}()
	r.ctx = ctx

	all := make([]*slot, len(r.slots))
	for i := range r.slots {
		all[i] = &r.slots[i]
	}
	completed := false
	defer func() {
		if completed {
			return
		}
		// A bug here, or runtime.Goexit in a processor: no member may be left waiting. Each
		// member gets a panic of the group, re-raised in its own goroutine.
		res := memberResult{err: errors.New("group commit stopped before its outcome was known")}
		if v := recover(); v != nil {
			res = memberResult{panic: &processor.PanicError{Value: v, Stack: debug.Stack()}}
		}
		for _, s := range all {
			if !s.final {
				s.finish(res)
			}
			r.send(s)
		}
		notifyJoined(r.joined)
	}()
	r.settle(all, false)
	for _, s := range all {
		r.send(s)
	}
	completed = true
	return r.joined
}

// notifyJoined hands the members that joined by Join their results. The last one that its
// consumer settles at once (it committed, or is a duplicate) ends the group: its consumer then
// sends the group's acknowledgements together (delivery.State.EndsGroup).
func notifyJoined(members []*member) {
	for _, m := range slices.Backward(members) {
		if m.res.panic != nil {
			continue
		}
		if o := processor.OutcomeOf(m.res.err); o == processor.Processed || o == processor.Duplicate {
			if st := delivery.From(m.ctx); st != nil {
				st.EndsGroup = true
			}
			break
		}
	}
	for _, m := range members {
		m.notifyResult()
	}
}

// step is what one transaction of a group left to do.
type step int

const (
	settled step = iota // every member of the set has its result
	rerun               // some members failed on their own: run the others again
	split               // a failure no member could be blamed for: run the set again in halves
)

// settle settles the members of set: it runs them in one transaction, and again without the
// members that fail, until every member has a result. With savepoints, each member runs under
// one, so that a failure rolls back alone.
func (r *groupRun) settle(set []*slot, savepoints bool) {
	for {
		pending := make([]*slot, 0, len(set))
		for _, s := range set {
			if !s.final {
				pending = append(pending, s)
			}
		}
		if len(pending) == 0 {
			return
		}
		switch r.attempt(pending, savepoints) {
		case settled:
			return
		case rerun:
			savepoints = r.g.cfg.Batch == nil
		case split:
			half := len(pending) / 2
			r.settle(pending[:half], false)
			r.settle(pending[half:], false)
			return
		}
	}
}

// attempt runs set, whose members have no result yet, in one transaction.
func (r *groupRun) attempt(set []*slot, savepoints bool) step {
	for _, s := range set {
		s.first, s.ok, s.carry = nil, false, false
	}
	tx, err := r.g.db.BeginTx(r.ctx, r.g.txOpts)
	if err != nil {
		r.endDedupSpans(err)
		r.failAll(set, fmt.Errorf("%w: begin transaction: %w", middleware.ErrGroupAborted, err))
		return settled
	}
	rollback := func() error {
		if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
			return fmt.Errorf("rollback: %w", err)
		}
		return nil
	}
	abort := func(cause error) step {
		if rbErr := rollback(); rbErr != nil {
			cause = errors.Join(cause, rbErr)
		}
		r.failAll(set, fmt.Errorf("%w: %w", middleware.ErrGroupAborted, cause))
		return settled
	}

	todo, refused, err := r.record(tx, set)
	if errors.Is(err, errRecordAgain) {
		if err := rollback(); err != nil {
			r.endDedupSpans(err)
			return abort(err)
		}
		r.readOutcomes = true
		return r.attempt(set, savepoints)
	}
	if err != nil {
		return abort(err)
	}
	if refused {
		// A member beyond the retention is dead-lettered; its key, recorded with the others,
		// must not commit: run the others again without it.
		if err := rollback(); err != nil {
			return abort(err)
		}
		return rerun
	}
	if r.g.cfg.Batch != nil {
		switch next, err := r.runBatch(tx, todo); {
		case err != nil:
			return abort(err)
		case next != settled:
			if err := rollback(); err != nil {
				return abort(err)
			}
			return next
		}
	} else {
		for _, s := range todo {
			if s.final { // stopped behind a member of its partition that was not applied
				continue
			}
			if savepoints {
				if err := r.runSaved(tx, s); errors.Is(err, errConflict) {
					// The transaction holds the locks of the members before s, which the
					// transaction s lost to may be waiting for: let them go, and run the
					// others again.
					if err := rollback(); err != nil {
						return abort(err)
					}
					return rerun
				} else if err != nil {
					return abort(err)
				}
				if !s.ok && r.g.positions != nil {
					r.stopBehind(todo, s)
				}
				continue
			}
			if !r.runMember(tx, s) || s.ok {
				if !s.ok && r.g.positions != nil {
					r.stopBehind(todo, s)
				}
				continue
			}
			// s failed on its own: roll back, and run the others again.
			if err := rollback(); err != nil {
				return abort(err)
			}
			return rerun
		}
	}
	// The ids of members that did not run (their context ended before their turn) were
	// recorded with the others: they must not commit.
	if r.g.store != nil && !savepoints {
		for _, s := range todo {
			if !s.ok {
				if err := r.g.store.Forget(r.ctx, tx, s.m.key); err != nil {
					return abort(fmt.Errorf("forget the id of message %q: %w", s.m.msg.ID, err))
				}
			}
		}
	}
	if r.g.positions != nil {
		if err := r.setPositions(tx, todo); err != nil {
			return abort(err)
		}
	}
	return r.commit(tx, set)
}

// runMember runs the rest of the chain for s on tx. It returns false, with s's result set,
// when s does not run because its context ended before its turn. Otherwise s.ok says whether
// it succeeded; when it did not, its failure is its result.
func (r *groupRun) runMember(tx middleware.Tx, s *slot) bool {
	if err := s.m.ctx.Err(); err != nil {
		s.finish(memberResult{err: fmt.Errorf("group commit: context ended before processing: %w", err)})
		return false
	}
	pe, err := r.call(tx, s)
	if pe == nil && err == nil {
		s.ok = true
		return true
	}
	s.finish(memberResult{err: err, panic: pe})
	return true
}

// runSaved runs s under its savepoint: a failure rolls back to it and forgets s's id, and the
// others go on. It returns errConflict when s lost to another transaction (a deadlock, a lock
// wait timeout), and another error when a statement of the group fails, which ends the
// transaction.
func (r *groupRun) runSaved(tx middleware.Tx, s *slot) error {
	if _, err := tx.ExecContext(r.ctx, "SAVEPOINT "+savepointName); err != nil {
		return fmt.Errorf("set savepoint: %w", err)
	}
	if r.runMember(tx, s) && s.ok {
		return nil
	}
	if s.res.panic == nil && sqldb.Classify(s.res.err) == sqldb.Conflict {
		return errConflict
	}
	if _, err := tx.ExecContext(r.ctx, "ROLLBACK TO SAVEPOINT "+savepointName); err != nil {
		return fmt.Errorf("roll back to savepoint after message %q failed: %w", s.m.msg.ID, err)
	}
	// The id was recorded before the savepoint: delete it, so that the redelivery is new.
	if r.g.store != nil {
		if err := r.g.store.Forget(r.ctx, tx, s.m.key); err != nil {
			return fmt.Errorf("forget the id of message %q: %w", s.m.msg.ID, err)
		}
	}
	return nil
}

// errConflict says that a member failed with a conflict of transactions (sqldb.Conflict).
// Rolling back to its savepoint would keep the locks of the members before it, which another
// group may wait for while this one waits for that group's: each next member would be a
// deadlock that the server takes a second to find.
var errConflict = errors.New("a member lost a conflict with another transaction")

// call runs the rest of the chain for s on tx, under s's own context, and catches a panic.
func (r *groupRun) call(tx middleware.Tx, s *slot) (pe *processor.PanicError, err error) {
	ctx, st := delivery.WithTx(s.m.ctx, tx)
	defer func() {
		st.EndTx()
		if v := recover(); v != nil {
			pe = asPanicError(v)
		}
	}()
	return nil, r.g.next.Process(ctx, s.m.msg)
}

func asPanicError(v any) *processor.PanicError {
	if p, ok := v.(*processor.PanicError); ok {
		return p
	}
	return &processor.PanicError{Value: v, Stack: debug.Stack()}
}

// transient reports whether err is a failure of the database or of the moment, not of any
// message: running the same messages again may succeed.
func transient(ctx context.Context, err error) bool {
	if ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	return sqldb.Classify(err) == sqldb.Conflict || sqldb.IsOutage(err)
}

// commit commits tx for the members of set that succeeded, or rolls it back when none did, and
// sets the results. A commit that fails for a reason one of several members may have caused (a
// deferred constraint) asks for the set to be run again in halves.
func (r *groupRun) commit(tx middleware.Tx, set []*slot) step {
	ok := make([]*slot, 0, len(set))
	for _, s := range set {
		if s.ok {
			ok = append(ok, s)
		}
	}
	if len(ok) == 0 {
		_ = tx.Rollback() // nothing to keep: the ids of failed members go with it
		r.settleCopies(set)
		return settled
	}
	if crashpoint.Armed() {
		for _, s := range ok {
			crashpoint.Reach(crashpoint.BeforeCommit, s.m.msg.ID)
		}
	}
	ends := childSpans(ok, telemetry.SpanCommit, r.size)
	err := tx.Commit()
	for _, end := range ends {
		end(err)
	}
	if err != nil {
		if c := sqldb.Classify(err); (c == sqldb.Data || c == sqldb.UniqueViolation) && len(ok) > 1 {
			for _, s := range set {
				s.ok = false
			}
			return split
		}
		err = sqltx.CommitFailed(err)
		for _, s := range ok {
			s.finish(memberResult{err: err})
		}
		r.settleCopies(set)
		return settled
	}
	at := time.Now()
	if committed := r.g.cfg.Committed; committed != nil {
		committed(r.ctx, len(ok))
	}
	for _, s := range ok {
		s.finish(memberResult{committedAt: at})
	}
	r.settleCopies(set)
	return settled
}

// endDedupSpans ends the dedup spans left open by a try that found an id not new, when the
// transaction that was to read the outcomes does not run.
func (r *groupRun) endDedupSpans(err error) {
	for _, end := range r.dedupSpans {
		end(err)
	}
	r.dedupSpans = nil
}

// childSpans starts the child span name of each member of set whose delivery is traced, with
// telemetry.AttrGroupSize when groupSize is not 0, and returns the functions that end them. It returns
// nil, allocating nothing, when no member is traced.
func childSpans(set []*slot, name string, groupSize int) []func(error) {
	var ends []func(error)
	for i, s := range set {
		if !s.m.traced {
			continue
		}
		if ends == nil {
			ends = make([]func(error), 0, len(set)-i)
		}
		ctx, end := telemetry.Child(s.m.ctx, name)
		if span := trace.SpanFromContext(ctx); groupSize != 0 && span.IsRecording() {
			span.SetAttributes(telemetry.AttrGroupSize.Int(groupSize))
		}
		ends = append(ends, end)
	}
	return ends
}

// settleCopies sets the result of the later copies of a message in set from the first copy's,
// once the first copy's is known.
func (r *groupRun) settleCopies(set []*slot) {
	for _, s := range set {
		if s.first == nil || s.final {
			continue
		}
		if !s.first.res.committedAt.IsZero() {
			s.finish(memberResult{err: fmt.Errorf("%w: id %q applied by another copy in the same group", processor.ErrDuplicate, s.m.msg.ID)})
		} else {
			s.finish(memberResult{err: fmt.Errorf("message %q: %w", s.m.msg.ID, errCopyFailed)})
		}
	}
}

// failAll gives every member of set that has no result yet cause.
func (r *groupRun) failAll(set []*slot, cause error) {
	for _, s := range set {
		if !s.final {
			s.finish(memberResult{err: cause})
		}
	}
}

// send hands s its result, once.
func (r *groupRun) send(s *slot) {
	if s.sent {
		return
	}
	s.sent = true
	if s.carry {
		r.g.rejoin(s.m)
		return
	}
	res := s.res
	if !s.final || (res.err == nil && res.panic == nil && res.committedAt.IsZero()) {
		// Never reached; a nil error would be acknowledged, and nothing was committed.
		res = memberResult{err: fmt.Errorf("group commit: message %q has no outcome", s.m.msg.ID)}
	}
	s.m.res = res
	if r.g.positions != nil {
		r.g.settledPosition(s.m, !res.committedAt.IsZero())
	}
	if s.m.notify != nil {
		r.joined = append(r.joined, s.m)
		return
	}
	s.m.done <- struct{}{} // the group's last use of the member, which its goroutine recycles
}
