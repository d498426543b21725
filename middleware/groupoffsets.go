package middleware

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// This file is GroupOffsets: group commit with duplicate detection by position. A group's
// members of one partition run in offset order in one transaction, and the partition's
// position is written once, the highest offset applied.

// predecessorWait bounds how long a member waits for the message before it in its partition
// to join the grouper first (see awaitPredecessor).
const predecessorWait = 50 * time.Millisecond

// GroupOffsets is GroupCommit with duplicate detection by position in place of a dedup row
// per message, for brokers that deliver each partition of a topic in order (Kafka, whose
// subscriber then hands out several records of a partition at once, in order:
// redelivery.WithPositionWindow). It is to GroupCommit what Offsets is to Deduplicate; it
// replaces Transaction and Offsets in a chain, with Retry outside it.
//
// A group's transaction locks the handler's position in each partition its members come from
// (store.Lock, in partition order, so that two groups never wait for each other), takes the
// members of each partition in offset order, and:
//
//   - a member at or below the applied offset is a duplicate (an error wrapping
//     processor.ErrDuplicate: the router acks);
//   - a member whose predecessor (messagedata.Position.Previous) is neither applied nor ahead
//     of it in the same transaction, and every member behind it in its partition, returns an
//     error wrapping ErrPositionAhead, retryable: no offset is applied past one that is not;
//   - the others run in offset order, as GroupCommit runs its members (or go to the batch
//     processor in one call, in that order), and the position of each partition is set once,
//     to the highest offset applied, before the one commit.
//
// A member that fails is isolated as GroupCommit isolates it: the group is rolled back and
// runs again without it, and the members behind it in its partition then wait for it (they
// return ErrPositionAhead and come again after it); a member that fails under its savepoint
// stops the members behind it in its partition the same way. Each message is acknowledged
// only after the commit that holds its effect and the position past it. A message that is
// dead-lettered is acknowledged without moving the position: the subscriber hands out the
// records behind it again with it acked, and they are applied then.
//
// A message without a position is refused with a permanent error, before it joins a group.
func GroupOffsets(db Beginner, store PositionStore, handler string, opts ...GroupOption) (Middleware, error) {
	if store == nil {
		return nil, errors.New("GroupOffsets: store is nil")
	}
	cfg, err := newGroupConfig(opts)
	if err == nil && cfg.dedupOptions {
		err = errors.New("a duplicate-detection option was given, but GroupOffsets records no message ids")
	}
	if err != nil {
		return nil, fmt.Errorf("GroupOffsets: %w", err)
	}
	txOpts := txOptions(cfg)
	return func(next processor.Processor) processor.Processor {
		g := &grouper{db: db, positions: store, handler: handler, cfg: cfg, txOpts: txOpts, next: next,
			joined: map[partitionKey]int64{}}
		return processor.Func(g.process)
	}, nil
}

// partitionKey names a partition of a topic.
type partitionKey struct {
	topic     string
	partition int32
}

// positionOf returns msg's position, or the permanent error of a message that has none.
func positionOf(msg *messagedata.MessageData) (messagedata.Position, error) {
	pos, ok, err := messagedata.PositionOf(msg)
	switch {
	case err != nil:
		return pos, processor.Permanent(fmt.Errorf("message position: %w", err))
	case !ok:
		return pos, processor.Permanent(fmt.Errorf("message has no position in an ordered log (headers %s and %s are empty): duplicate detection by offsets needs a broker with partitions",
			messagedata.HeaderPartition, messagedata.HeaderOffset))
	}
	return pos, nil
}

// awaitPredecessor waits, up to predecessorWait, until the message before m in its partition
// that was not acknowledged when m was handed out has joined the grouper: the subscriber hands
// them out in order, but their goroutines may reach the grouper in any order, and a member
// that ran in a group before its predecessor would only be retried. It returns at once when
// the predecessor has joined, or there is none.
func (g *grouper) awaitPredecessor(m *member) {
	if m.pos.Previous < 0 {
		return
	}
	key := partitionKey{m.msg.Topic, m.pos.Partition}
	var timer *time.Timer
	for {
		g.mu.Lock()
		if j, ok := g.joined[key]; ok && j >= m.pos.Previous {
			g.mu.Unlock()
			break
		}
		if g.joinedChanged == nil {
			g.joinedChanged = make(chan struct{})
		}
		changed := g.joinedChanged
		g.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(predecessorWait)
		}
		select {
		case <-changed:
			continue
		case <-timer.C:
		case <-m.ctx.Done():
		}
		break
	}
	if timer != nil {
		timer.Stop()
	}
}

// joinedLocked records that m joined, for the members that wait for it; g.mu is held.
func (g *grouper) joinedLocked(m *member) {
	key := partitionKey{m.msg.Topic, m.pos.Partition}
	if j, ok := g.joined[key]; !ok || m.pos.Offset > j {
		g.joined[key] = m.pos.Offset
	}
	if g.joinedChanged != nil {
		close(g.joinedChanged)
		g.joinedChanged = nil
	}
}

// inPartitionOrder sorts slots by partition, then offset: the order in which a group's
// transaction locks the partitions' positions and runs the members.
func inPartitionOrder(slots []slot) {
	slices.SortStableFunc(slots, func(a, b slot) int {
		return cmp.Or(cmp.Compare(a.m.msg.Topic, b.m.msg.Topic), cmp.Compare(a.m.pos.Partition, b.m.pos.Partition),
			cmp.Compare(a.m.pos.Offset, b.m.pos.Offset))
	})
}

func samePartition(a, b *slot) bool {
	return a.m.pos.Partition == b.m.pos.Partition && a.m.msg.Topic == b.m.msg.Topic
}

// lockPositions locks, in tx, the position of each partition of set, whose members are in
// partition order, and returns the members to process. A duplicate, and a member that comes
// before its predecessor is applied, gets its result and is sent it at once; a later copy of
// a member (the same offset) waits for the first copy's outcome.
func (r *groupRun) lockPositions(tx processor.Tx, set []*slot) ([]*slot, error) {
	todo := make([]*slot, 0, len(set))
	var applied int64
	for i, s := range set {
		pos := s.m.pos
		if i == 0 || !samePartition(set[i-1], s) {
			ends := childSpans(set[i:i+1], telemetry.SpanDedup, 0)
			var err error
			applied, err = r.g.positions.Lock(r.ctx, tx, r.g.handler, s.m.msg.Topic, pos.Partition)
			for _, end := range ends {
				end(err)
			}
			if err != nil {
				return nil, fmt.Errorf("lock the position of partition %d: %w", pos.Partition, err)
			}
		} else if prev := set[i-1]; prev.m.pos.Offset == pos.Offset {
			// Another delivery of the same record.
			switch {
			case prev.first != nil:
				s.first = prev.first
			case prev.final:
				s.finish(prev.res)
				r.send(s)
			default:
				s.first = prev
			}
			continue
		}
		switch {
		case pos.Offset <= applied:
			s.finish(memberResult{err: fmt.Errorf("%w: offset %d of partition %d is at or below the last applied, %d", processor.ErrDuplicate, pos.Offset, pos.Partition, applied)})
			r.send(s)
		case pos.Previous > applied:
			s.finish(memberResult{err: fmt.Errorf("%w: offset %d of partition %d follows %d, and the last applied is %d", ErrPositionAhead, pos.Offset, pos.Partition, pos.Previous, applied)})
			r.send(s)
		default:
			todo = append(todo, s)
			applied = pos.Offset
		}
	}
	return todo, nil
}

// stopBehind gives every member of todo behind s in its partition, that has no result yet,
// ErrPositionAhead: s, before them, was not applied in this transaction.
func (r *groupRun) stopBehind(todo []*slot, s *slot) {
	i := slices.Index(todo, s)
	for _, t := range todo[i+1:] {
		if !samePartition(s, t) {
			return
		}
		if !t.final && !t.ok {
			t.finish(memberResult{err: fmt.Errorf("%w: offset %d of partition %d follows %d, which was not applied in its group's transaction", ErrPositionAhead, t.m.pos.Offset, t.m.pos.Partition, s.m.pos.Offset)})
		}
	}
}

// setPositions sets, in tx, the position of each partition of todo to the highest offset of
// its members that succeeded: with stopBehind, they are the first of the partition's members.
func (r *groupRun) setPositions(tx processor.Tx, todo []*slot) error {
	for i, s := range todo {
		if !s.ok || (i+1 < len(todo) && samePartition(s, todo[i+1]) && todo[i+1].ok) {
			continue
		}
		if err := r.g.positions.Set(r.ctx, tx, r.g.handler, s.m.msg.Topic, s.m.pos.Partition, s.m.pos.Offset); err != nil {
			return err
		}
	}
	return nil
}
