package groupcommit

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file is GroupOffsets: group commit with duplicate detection by position. A group's
// members of one partition run in offset order in one transaction, and the partition's
// position is written once, the highest offset applied.

// predecessorWait bounds how long a member waits for the message before it in its partition
// to join the grouper first (see awaitPredecessor).
const predecessorWait = 500 * time.Millisecond

// GroupOffsets, a group transaction with Config.Positions, is group commit with duplicate
// detection by position in place of a dedup row per message, for brokers that deliver each
// partition of a topic in order (Kafka, whose subscriber then hands out several records of a
// partition at once, in order: redelivery.WithPositionWindow). It is to group commit what
// middleware.DedupByOffset is to a transaction per message.
//
// Members collect in groups by lanes of partitions (partition modulo Config.Concurrency), so
// that the groups that run at once hold different partitions; a group that holds a partition
// runs after the groups that started before it with that partition, since it needs the
// position they commit. A member whose predecessor in its partition
// (messagedata.Position.Previous) has not reached the grouper yet waits for it briefly, so
// that it joins the same group or a later one.
//
// A group's transaction locks the handler's position in each partition its members come from
// (store.Lock, in partition order, so that two groups cannot deadlock), takes the members of
// each partition in offset order, and:
//
//   - a member at or below the applied offset is a duplicate (an error wrapping
//     processor.ErrDuplicate: the router acks);
//   - a member whose predecessor is neither applied nor ahead of it in the same transaction
//     follows the predecessor to the next group when the predecessor waits in the grouper
//     (it was retried), a few times at most; otherwise it, and every member behind it in its
//     partition, returns an error wrapping middleware.ErrPositionAhead, retryable: no offset is applied
//     past one that is not;
//   - the others run in offset order, as GroupCommit runs its members (or go to the batch
//     processor in one call, in that order), and the position of each partition is set once,
//     to the highest offset applied, before the one commit.
//
// A member that fails is isolated as GroupCommit isolates it: the group is rolled back and
// runs again without it, and the members behind it in its partition then wait for it (they
// return middleware.ErrPositionAhead and come again after it); a member that fails under its savepoint
// stops the members behind it in its partition the same way. Each message is acknowledged
// only after the commit that holds its effect and the position past it. A message that is
// dead-lettered is acknowledged without moving the position: the subscriber hands out the
// records behind it again with it acked, and they are applied then.
//
// A message without a position is refused with a permanent error, before it joins a group.

// partitionKey names a partition of a topic.
type partitionKey struct {
	topic     string
	partition int32
}

// partitionBooks is what GroupOffsets keeps of the partitions of its members, guarded by
// grouper.mu.
type partitionBooks struct {
	// pending counts the members of each position that have joined and have no result yet;
	// committed is the highest offset of each partition that a group committed.
	pending   map[positionKey]int
	committed map[partitionKey]int64
	// waiters are, for each position that members wait for (awaitPredecessor), a channel
	// closed when it joins: each join wakes only the member that waits for it.
	waiters map[positionKey]chan struct{}
	// groups is the group that started last among those running with members of each
	// partition (see orderLocked).
	groups map[partitionKey]*group
}

// positionKey names a record of a partition.
type positionKey struct {
	partitionKey
	offset int64
}

// awaitPredecessor waits, up to predecessorWait, until the message before m in its partition
// that was not acknowledged when m was handed out (m.pos.Previous) has joined the grouper and
// waits for its result, or was committed by it: the subscriber hands them out in order, but
// their goroutines may reach the grouper in any order, and between two attempts a message is
// not in the grouper. A member that ran in a group before its predecessor would only find
// itself ahead of the position, and be retried. It returns at once when there is no
// predecessor.
func (g *grouper) awaitPredecessor(m *member) {
	if m.pos.Previous < 0 {
		return
	}
	part := partitionKey{m.msg.Topic, m.pos.Partition}
	prev := positionKey{part, m.pos.Previous}
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		g.mu.Lock()
		if c, ok := g.books.committed[part]; g.books.pending[prev] > 0 || ok && c >= prev.offset {
			g.mu.Unlock()
			return
		}
		if g.books.waiters == nil {
			g.books.waiters = map[positionKey]chan struct{}{}
		}
		joined := g.books.waiters[prev]
		if joined == nil {
			joined = make(chan struct{})
			g.books.waiters[prev] = joined
		}
		g.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(predecessorWait)
		}
		select {
		case <-joined:
		case <-timer.C:
			return
		case <-m.ctx.Done():
			return
		}
	}
}

// maxCarries bounds how many times a member follows its predecessor to a later group.
const maxCarries = 8

// carries reports whether m, whose predecessor is not applied, is to join the next group
// instead of failing with middleware.ErrPositionAhead: its predecessor has joined the grouper and waits
// for its result (in a later group: it was retried), and m has not been carried maxCarries
// times. A member carried joins again when its group ends (rejoin).
func (g *grouper) carries(m *member) bool {
	if m.carried >= maxCarries {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.books.pending[positionKey{partitionKey{m.msg.Topic, m.pos.Partition}, m.pos.Previous}] > 0
}

// rejoin has m, which its group carries, join the next group, as it would join at first.
func (g *grouper) rejoin(m *member) {
	m.carried++
	g.settledPosition(m, false) // join counts it again
	m.state.Store(memberWaiting)
	g.join(m)
}

// joinedLocked records that m joined grp; g.mu is held.
func (b *partitionBooks) joinedLocked(grp *group, m *member) {
	if b.pending == nil {
		b.pending, b.committed = map[positionKey]int{}, map[partitionKey]int64{}
	}
	part := partitionKey{m.msg.Topic, m.pos.Partition}
	if !slices.Contains(grp.parts, part) {
		grp.parts = append(grp.parts, part)
	}
	key := positionKey{part, m.pos.Offset}
	b.pending[key]++
	if joined := b.waiters[key]; joined != nil {
		close(joined)
		delete(b.waiters, key)
	}
}

// settledPosition records that m has its result, committed or not.
func (g *grouper) settledPosition(m *member, committed bool) {
	part := partitionKey{m.msg.Topic, m.pos.Partition}
	key := positionKey{part, m.pos.Offset}
	g.mu.Lock()
	defer g.mu.Unlock()
	b := &g.books
	if b.pending[key]--; b.pending[key] <= 0 {
		delete(b.pending, key)
	}
	if c, ok := b.committed[part]; committed && (!ok || m.pos.Offset > c) {
		b.committed[part] = m.pos.Offset
	}
}

// lane returns the open group m joins: for GroupOffsets, the partition's lane, so that the
// groups that run at once hold different partitions and do not wait for each other's commits
// (a group that holds a partition runs after the one before it that holds it: orderLocked);
// otherwise the member's own (Join's lane, 0 for Process).
func (g *grouper) lane(m *member) int {
	switch {
	case g.positions == nil:
		return m.lane
	case len(g.opens) == 1:
		return 0
	}
	return int(m.pos.Partition) % len(g.opens)
}

// orderLocked makes grp, which starts now, run after the groups running with members of the
// same partitions: a group that locked a partition's position before the group that started
// before it would find its members ahead of the position, to be retried. g.mu is held.
func (g *grouper) orderLocked(grp *group) {
	grp.done = make(chan struct{})
	if g.books.groups == nil {
		g.books.groups = map[partitionKey]*group{}
	}
	for _, key := range grp.parts {
		if before := g.books.groups[key]; before != nil && !slices.Contains(grp.after, before) {
			grp.after = append(grp.after, before)
		}
		g.books.groups[key] = grp
	}
}

// waitsLocked reports whether grp, an open or ready group, would wait for a running group if it
// started now (GroupOffsets: one holding a partition of its; otherwise one of its lane): it then
// goes on collecting members, and leaves the transaction to a group that can run. g.mu is held.
func (g *grouper) waitsLocked(grp *group) bool {
	if g.positions == nil {
		return grp.lane > 0 && grp.lane < len(g.busyLanes) && g.busyLanes[grp.lane]
	}
	for _, key := range grp.parts {
		if g.books.groups[key] != nil {
			return true
		}
	}
	return false
}

// setLaneBusyLocked records whether lane (Join's, above 0) has a group running; g.mu is held.
// GroupOffsets orders its groups by partition instead.
func (g *grouper) setLaneBusyLocked(lane int, busy bool) {
	if lane == 0 || g.positions != nil {
		return
	}
	if lane >= len(g.busyLanes) {
		g.busyLanes = append(g.busyLanes, make([]bool, lane+1-len(g.busyLanes))...)
	}
	g.busyLanes[lane] = busy
}

// endedLocked records that grp has run; g.mu is held.
func (g *grouper) endedLocked(grp *group) {
	close(grp.done)
	for key, last := range g.books.groups {
		if last == grp {
			delete(g.books.groups, key)
		}
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
// before its predecessor is applied, gets its result and is sent it before the return; a
// later copy of a member (the same offset) waits for the first copy's outcome.
func (r *groupRun) lockPositions(tx middleware.Tx, set []*slot) ([]*slot, error) {
	// A member sent its result is recycled by its goroutine at once: the positions are read
	// first, and the results sent once the loop no longer looks at the members.
	keys := make([]positionKey, len(set))
	for i, s := range set {
		keys[i] = positionKey{partitionKey{s.m.msg.Topic, s.m.pos.Partition}, s.m.pos.Offset}
	}
	var early []*slot
	defer func() {
		for _, s := range early {
			r.send(s)
		}
	}()
	todo := make([]*slot, 0, len(set))
	var applied int64
	for i, s := range set {
		pos := s.m.pos
		if i == 0 || keys[i-1].partitionKey != keys[i].partitionKey {
			ends := childSpans(set[i:i+1], telemetry.SpanDedup, 0)
			var err error
			applied, err = r.g.positions.Lock(r.ctx, tx, r.g.handler, keys[i].topic, pos.Partition)
			for _, end := range ends {
				end(err)
			}
			if err != nil {
				return nil, fmt.Errorf("lock the position of partition %d: %w", pos.Partition, err)
			}
		} else if prev := set[i-1]; keys[i-1].offset == pos.Offset {
			// Another delivery of the same record.
			switch {
			case prev.first != nil:
				s.first = prev.first
			case prev.final:
				s.finish(prev.res)
				early = append(early, s)
			default:
				s.first = prev
			}
			continue
		}
		switch {
		case pos.Offset <= applied:
			s.finish(memberResult{err: fmt.Errorf("%w: offset %d of partition %d is at or below the last applied, %d", processor.ErrDuplicate, pos.Offset, pos.Partition, applied)})
			early = append(early, s)
		case pos.Previous > applied && r.g.carries(s.m):
			// Its predecessor waits in the grouper: it follows it to a later group.
			s.carry = true
			s.finish(memberResult{})
		case pos.Previous > applied:
			s.finish(memberResult{err: fmt.Errorf("%w: offset %d of partition %d follows %d, and the last applied is %d", middleware.ErrPositionAhead, pos.Offset, pos.Partition, pos.Previous, applied)})
			early = append(early, s)
		default:
			todo = append(todo, s)
			applied = pos.Offset
		}
	}
	return todo, nil
}

// stopBehind gives every member of todo behind s in its partition, that has no result yet,
// middleware.ErrPositionAhead: s, before them, was not applied in this transaction.
func (r *groupRun) stopBehind(todo []*slot, s *slot) {
	i := slices.Index(todo, s)
	for _, t := range todo[i+1:] {
		if !samePartition(s, t) {
			return
		}
		if !t.final && !t.ok {
			t.finish(memberResult{err: fmt.Errorf("%w: offset %d of partition %d follows %d, which was not applied in its group's transaction", middleware.ErrPositionAhead, t.m.pos.Offset, t.m.pos.Partition, s.m.pos.Offset)})
		}
	}
}

// setPositions sets, in tx, the position of each partition of todo to the highest offset of
// its members that succeeded: with stopBehind, they are the first of the partition's members.
func (r *groupRun) setPositions(tx middleware.Tx, todo []*slot) error {
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
