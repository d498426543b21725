package groupcommit

import (
	"fmt"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file hands a group's new members to a batch processor in one call: a failure that names
// its messages gives them their results, one that names none splits the group.

// runBatch hands the members of todo to the batch processor in tx. It returns settled when the
// batch succeeded (every member that took part is ok), rerun when the batch named failing
// messages (they have their results), split when it failed without naming any, and an error
// when it failed for a reason of the database or the moment (a lost connection, a conflict, a
// canceled context), which ends the whole transaction retryably.
func (r *groupRun) runBatch(tx middleware.Tx, todo []*slot) (step, error) {
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
func (r *groupRun) callBatch(tx middleware.Tx, msgs []*messagedata.MessageData) (pe *processor.PanicError, err error) {
	defer func() {
		if v := recover(); v != nil {
			pe = asPanicError(v)
		}
	}()
	return nil, r.g.cfg.Batch.ProcessBatch(middleware.WithTx(r.ctx, tx), msgs)
}
