package middleware

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// This file runs one group of GroupCommit or GroupTransaction: its transactions, the reruns
// without the members that fail, and each member's result.

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
}

// run runs the group of members and hands every member its result.
func (g *grouper) run(members []*member) {
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
	// last has ended; it stops with the group.
	ends := make([]<-chan struct{}, len(r.slots))
	for i := range r.slots {
		ends[i] = r.slots[i].m.ctx.Done()
	}
	go func() {
		for _, done := range ends {
			select {
			case <-done:
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
	}()
	r.settle(all, false)
	for _, s := range all {
		r.send(s)
	}
	completed = true
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
			savepoints = r.g.cfg.batch == nil
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
		r.failAll(set, fmt.Errorf("%w: begin transaction: %w", ErrGroupAborted, err))
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
		r.failAll(set, fmt.Errorf("%w: %w", ErrGroupAborted, cause))
		return settled
	}

	todo, refused, err := r.record(tx, set)
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
	if r.g.cfg.batch != nil {
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
				if err := r.runSaved(tx, s); err != nil {
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

// record records the ids of set in tx and returns the members to process: the new ones. A
// duplicate gets its result; a later copy of a message in the set waits for the first copy's
// outcome. Without duplicate detection every member is new. refused reports a member beyond
// the retention horizon that the retention policy dead-letters: it has its result, and the
// transaction must not commit the key recorded for it.
func (r *groupRun) record(tx Tx, set []*slot) (todo []*slot, refused bool, err error) {
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
	ends := childSpans(set, telemetry.SpanDedup, 0)
	fresh, err := r.recordKeys(tx, keys)
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
	// A later copy of a message in set is never new (GroupStore.RecordMany): only when a member
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
				if err := r.g.cfg.dedup.checkRetention(s.m.ctx, s.m.msg, fresh[i], r.g.retention); err != nil {
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

// recordKeys records keys with the store's RecordKeys when it has one, which tells renewed
// expired keys apart, and with RecordMany otherwise.
func (r *groupRun) recordKeys(tx Tx, keys []dedup.Key) ([]dedup.Outcome, error) {
	if kr, ok := r.g.store.(keysRecorder); ok {
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
func (r *groupRun) recordOneByOne(tx Tx, keys []dedup.Key, set []*slot) ([]dedup.Outcome, error) {
	fresh := make([]dedup.Outcome, len(keys))
	for i, k := range keys {
		f, err := r.recordKeys(tx, []dedup.Key{k})
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

// runMember runs the rest of the chain for s on tx. It returns false, with s's result set,
// when s does not run because its context ended before its turn. Otherwise s.ok says whether
// it succeeded; when it did not, its failure is its result.
func (r *groupRun) runMember(tx Tx, s *slot) bool {
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
// others go on. It returns an error only when a statement of the group fails, which ends the
// transaction.
func (r *groupRun) runSaved(tx Tx, s *slot) error {
	if _, err := tx.ExecContext(r.ctx, "SAVEPOINT "+savepointName); err != nil {
		return fmt.Errorf("set savepoint: %w", err)
	}
	if r.runMember(tx, s) && s.ok {
		return nil
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

// call runs the rest of the chain for s on tx, under s's own context, and catches a panic.
func (r *groupRun) call(tx Tx, s *slot) (pe *processor.PanicError, err error) {
	defer func() {
		if v := recover(); v != nil {
			pe = asPanicError(v)
		}
	}()
	return nil, r.g.next.Process(WithTx(s.m.ctx, tx), s.m.msg)
}

func asPanicError(v any) *processor.PanicError {
	if p, ok := v.(*processor.PanicError); ok {
		return p
	}
	return &processor.PanicError{Value: v, Stack: debug.Stack()}
}

// runBatch hands the members of todo to the batch processor in tx. It returns settled when the
// batch succeeded (every member that took part is ok), rerun when the batch named failing
// messages (they have their results), split when it failed without naming any, and an error
// when it failed for a reason of the database or the moment (a lost connection, a conflict, a
// canceled context), which ends the whole transaction retryably.
func (r *groupRun) runBatch(tx Tx, todo []*slot) (step, error) {
	live := make([]*slot, 0, len(todo))
	for _, s := range todo {
		if s.final { // stopped behind a member of its partition that left
			continue
		}
		if err := s.m.ctx.Err(); err != nil {
			s.finish(memberResult{err: fmt.Errorf("group commit: context ended before processing: %w", err)})
			if r.g.positions != nil {
				r.stopBehind(todo, s)
			}
			continue
		}
		live = append(live, s)
	}
	if len(live) == 0 {
		return settled, nil
	}
	msgs := make([]*messagedata.MessageData, len(live))
	for i, s := range live {
		msgs[i] = s.m.msg
	}
	pe, err := r.callBatch(tx, msgs)
	if pe == nil && err == nil {
		for _, s := range live {
			s.ok = true
		}
		return settled, nil
	}
	if pe == nil {
		if named := processor.MessageErrors(err); len(named) > 0 {
			byMsg := make(map[*messagedata.MessageData]error, len(named))
			for _, e := range named {
				byMsg[e.Message] = e.Err
			}
			blamed := false
			for _, s := range live {
				if e, ok := byMsg[s.m.msg]; ok {
					s.finish(memberResult{err: e})
					blamed = true
				}
			}
			if blamed {
				return rerun, nil
			}
			// It named only messages that are not in the batch: nobody is to blame yet.
		}
		if transient(r.ctx, err) {
			return settled, fmt.Errorf("batch processor: %w", err)
		}
	}
	if len(live) == 1 {
		live[0].finish(memberResult{err: err, panic: pe})
		return rerun, nil
	}
	return split, nil
}

// callBatch runs the batch processor on tx and catches a panic.
func (r *groupRun) callBatch(tx Tx, msgs []*messagedata.MessageData) (pe *processor.PanicError, err error) {
	defer func() {
		if v := recover(); v != nil {
			pe = asPanicError(v)
		}
	}()
	return nil, r.g.cfg.batch.ProcessBatch(WithTx(r.ctx, tx), msgs)
}

// transient reports whether err is a failure of the database or of the moment, not of any
// message: running the same messages again may succeed.
func transient(ctx context.Context, err error) bool {
	if ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	switch sqldb.Classify(err) {
	case sqldb.Conflict, sqldb.Connection:
		return true
	}
	return false
}

// commit commits tx for the members of set that succeeded, or rolls it back when none did, and
// sets the results. A commit that fails for a reason one of several members may have caused (a
// deferred constraint) asks for the set to be run again in halves.
func (r *groupRun) commit(tx Tx, set []*slot) step {
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
		err = commitError(err)
		for _, s := range ok {
			s.finish(memberResult{err: err})
		}
		r.settleCopies(set)
		return settled
	}
	at := time.Now()
	for _, s := range ok {
		s.finish(memberResult{committedAt: at})
	}
	r.settleCopies(set)
	return settled
}

// childSpans starts the child span name of each member of set whose delivery is traced, with
// AttrGroupSize when groupSize is not 0, and returns the functions that end them. It returns
// nil, allocating nothing, when no member is traced.
func childSpans(set []*slot, name string, groupSize int) []func(error) {
	var ends []func(error)
	for i, s := range set {
		if !trace.SpanFromContext(s.m.ctx).IsRecording() {
			continue
		}
		if ends == nil {
			ends = make([]func(error), 0, len(set)-i)
		}
		ctx, end := telemetry.Child(s.m.ctx, name)
		if span := trace.SpanFromContext(ctx); groupSize != 0 && span.IsRecording() {
			span.SetAttributes(AttrGroupSize.Int(groupSize))
		}
		ends = append(ends, end)
	}
	return ends
}

// commitError is the error of a failed COMMIT: one wrapping ErrCommitOutcomeUnknown when the
// connection was lost while it was in flight (it may have committed), or ctx ended.
func commitError(err error) error {
	if sqldb.Classify(err) == sqldb.Connection || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %w", ErrCommitOutcomeUnknown, err)
	}
	return fmt.Errorf("commit: %w", err)
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
	s.m.done <- struct{}{} // the group's last use of the member, which its goroutine recycles
}
