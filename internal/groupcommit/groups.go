package groupcommit

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file forms the groups of GroupCommit and GroupTransaction: members join, groups start
// as transactions become free; grouprun.go runs one group's transactions.

// grouper forms the groups of one chain and runs them.
type grouper struct {
	db    middleware.Beginner
	store Store // nil: no duplicate detection by id
	// positions, for GroupOffsets, detect duplicates by position; books are its partitions,
	// guarded by mu.
	positions *dedup.Positions
	books     partitionBooks
	handler   string
	cfg       groupConfig
	txOpts    *sql.TxOptions
	next      processor.Processor
	// retention is the store's retention, when it says, for messages older than it.
	retention time.Duration

	mu sync.Mutex
	// opens are the groups that members join, nil where there is none: one, or, for
	// GroupOffsets, one per lane of partitions (see lane).
	opens    []*group
	nextOpen int      // the open group that startLocked looks at first
	ready    []*group // full, or done waiting, and waiting for a transaction
	running  int      // groups whose transactions run
	// lastSize is the size of the group that started last: a new group's room for members,
	// which grows by copying otherwise.
	lastSize int
	// busyLanes are the lanes of Join (above 0) that have a group running, indexed by lane.
	busyLanes []bool
}

type group struct {
	members []*member
	timer   *time.Timer
	waited  bool // MaxWait has passed, or there was none
	// For GroupOffsets: parts are the partitions of its members; after are the groups that
	// started before this one with members of the same partitions: it runs after they end,
	// which closes their done.
	parts []partitionKey
	after []*group
	done  chan struct{}
	// lane is the lane of the group's members (Join's, 0 for the shared one), whatever
	// GroupOffsets' partition lanes are.
	lane int
}

// Member states. A member waits until its group claims it (its group starts, or hands it a
// result early) or it leaves; whichever comes first decides. A claimed member waits for its
// result.
const (
	memberWaiting int32 = iota
	memberClaimed
	memberLeft
)

type member struct {
	ctx context.Context
	msg *messagedata.MessageData
	key dedup.Key
	pos messagedata.Position // for GroupOffsets
	// carried counts the groups that carried the member to the next one (GroupOffsets).
	carried int
	state   atomic.Int32
	res     memberResult // set once, before the value on done
	// done receives one value once res is set; it has room for it, so that the group never
	// blocks on a member. A member that joined by Join has notify instead, which the group
	// hands the result.
	done   chan struct{}
	notify Joined
	// lane is the lane the member joined by Join; 0 for the shared one, and for one that came
	// by Process.
	lane int
	// kept: the member is the Slot of its caller, not the pool's.
	kept bool
	// traced: the span in ctx records, so the group starts child spans of it (childSpans).
	traced bool
}

// Slot is the place in a group of a message that joins it by Join, kept by the caller (in its
// own state of the delivery), so that joining takes no member from the pool, which the
// collector empties. A slot holds one message, from Join until its result; the zero value is
// ready.
type Slot struct{ m member }

// members recycles the members that have taken their result: a member and its channel would
// be two allocations per message. A member that left its group is not recycled: the group may
// still look at it, to find that it has left.
var members = sync.Pool{New: func() any { return &member{done: make(chan struct{}, 1)} }}

type memberResult struct {
	err         error
	panic       *processor.PanicError
	committedAt time.Time
}

func (m *member) claim() bool { return m.state.CompareAndSwap(memberWaiting, memberClaimed) }

// process is the Processor of the chain: it runs in each delivery's goroutine.
func (g *grouper) process(ctx context.Context, msg *messagedata.MessageData) error {
	if st := delivery.From(ctx); st != nil && st.Joined {
		// The first attempt ran through Join, and its result sent the delivery through the
		// chain: this is that attempt's result.
		err := st.JoinedErr
		st.Joined, st.JoinedErr = false, nil
		if pe, ok := err.(*processor.PanicError); ok {
			panic(pe)
		}
		return err
	}
	m, err := g.member(ctx, msg, nil)
	if err != nil {
		return err
	}
	if g.positions != nil {
		g.awaitPredecessor(m)
	}
	g.join(m)
	select {
	case <-m.done:
		return m.settle()
	case <-ctx.Done():
	}
	if m.state.CompareAndSwap(memberWaiting, memberLeft) {
		g.leave(m)
		return fmt.Errorf("group commit: left the group before processing: %w", ctx.Err())
	}
	// The group has claimed the member: its result is on the way.
	<-m.done
	return m.settle()
}

// Join hands msg to a group directly, without a goroutine waiting for it: it returns at once,
// and done gets msg's result once (Joined), from the goroutine of the group that ran it, after
// the outcome of its transaction is known. The result is what Process would return: nil once
// committed, an error wrapping processor.ErrDuplicate for a duplicate, the message's own error,
// or a *processor.PanicError for a panic, which done gets as its error (Join re-raises
// nothing).
//
// lane, when above 0, names the stream the message comes from (the router gives each of a
// handler's subscriptions one): the messages of a lane form groups of their own, and a lane has
// at most one group running, while its next group collects what arrives meanwhile, as a
// consumer of one subscription that runs one transaction at a time batches what arrives during
// it. A busy broker so fills the groups instead of starting a transaction for every few
// messages, and an idle one has a lone message's group start at once. Lane 0 is shared by every
// message joined with it and every message that comes by Process, without the limit.
// (GroupOffsets groups by partition whatever the lane.)
//
// slot, when not nil, is the message's place in its group (Slot); nil takes one from a pool.
//
// A message Join refuses before it joins a group (it has no id, or no position, or its context
// has ended) gets its result at once, in the caller's goroutine.
func (g *grouper) Join(ctx context.Context, msg *messagedata.MessageData, lane int, slot *Slot, done Joined) {
	m, err := g.member(ctx, msg, slot)
	if err != nil {
		done.Joined(err)
		return
	}
	m.lane = max(lane, 0)
	// GroupOffsets: a joined member does not wait for its predecessor, which a consumer that
	// joins in the order the subscriber hands out has joined before it. One that is between
	// two attempts makes the member wait in a later group, or fail retryably (middleware.ErrPositionAhead)
	// and come back by Process, which waits.
	m.notify = done
	g.join(m)
}

// member returns the member of msg, slot's or else one of the pool, or the error that refuses
// msg before it joins a group: it has no id (GroupCommit) or no position (GroupOffsets), or ctx
// has ended.
func (g *grouper) member(ctx context.Context, msg *messagedata.MessageData, slot *Slot) (*member, error) {
	key, err := g.keyOf(msg)
	if err != nil {
		return nil, err
	}
	var pos messagedata.Position
	if g.positions != nil {
		if pos, err = dedup.PositionOf(msg); err != nil {
			return nil, err
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("group commit: %w", err)
	}
	var m *member
	if slot != nil {
		m = &slot.m
		m.kept = true
	} else {
		m = members.Get().(*member)
	}
	m.ctx, m.msg, m.key, m.pos = ctx, msg, key, pos
	m.traced = trace.SpanFromContext(ctx).IsRecording()
	return m, nil
}

// keyOf returns the duplicate-detection key of msg; the zero key for a group without
// duplicate detection by id.
func (g *grouper) keyOf(msg *messagedata.MessageData) (dedup.Key, error) {
	if g.store == nil {
		return dedup.Key{}, nil
	}
	if msg.ID == "" {
		return dedup.Key{}, processor.Permanent(messagedata.ErrNoMessageID)
	}
	return dedup.KeyOf(g.handler, msg, g.cfg.WithTimestamp), nil
}

// notifyResult hands a member that joined by Join its result, in the group's goroutine, and
// recycles the member: the group is done with it.
func (m *member) notifyResult() {
	r, ctx, notify := m.res, m.ctx, m.notify
	m.recycle()
	err := r.err
	switch {
	case r.panic != nil:
		err = r.panic
	case !r.committedAt.IsZero():
		delivery.MarkCommitted(ctx, r.committedAt)
	}
	notify.Joined(err)
}

// recycle clears m and puts it back in the pool, or leaves it to its slot's keeper.
func (m *member) recycle() {
	kept := m.kept
	m.ctx, m.msg, m.key, m.pos, m.carried, m.res, m.notify, m.lane, m.kept, m.traced = nil, nil, dedup.Key{}, messagedata.Position{}, 0, memberResult{}, nil, 0, false, false
	m.state.Store(memberWaiting)
	if !kept {
		members.Put(m)
	}
}

// settle returns the member's result, which it has received, in its own goroutine, and
// recycles the member: the group is done with it. It re-raises a panic of its chain, and
// records the commit.
func (m *member) settle() error {
	r, ctx := m.res, m.ctx
	m.recycle()
	if r.panic != nil {
		panic(r.panic)
	}
	if !r.committedAt.IsZero() {
		delivery.MarkCommitted(ctx, r.committedAt)
	}
	return r.err
}

// join adds m to the open group, creating it if needed, and starts what may start.
func (g *grouper) join(m *member) {
	g.mu.Lock()
	lane := g.lane(m)
	if lane >= len(g.opens) {
		g.opens = append(g.opens, make([]*group, lane+1-len(g.opens))...)
	}
	grp := g.opens[lane]
	if grp == nil {
		grp = &group{waited: g.cfg.MaxWait == 0, members: make([]*member, 0, max(g.lastSize, 1)), lane: m.lane}
		g.opens[lane] = grp
	}
	grp.members = append(grp.members, m)
	if g.positions != nil {
		g.books.joinedLocked(grp, m)
	}
	size := len(grp.members)
	switch {
	case size >= g.cfg.maxSize:
		g.opens[lane] = nil
		g.stopTimer(grp)
		g.ready = append(g.ready, grp)
	case !grp.waited && grp.timer == nil && g.running < g.cfg.concurrency:
		grp.timer = time.AfterFunc(g.cfg.MaxWait, func() { g.expire(grp) })
	}
	starts := g.startLocked()
	g.mu.Unlock()
	if g.cfg.joined != nil {
		g.cfg.joined(size)
	}
	g.launch(starts)
}

// expire marks grp as done waiting and starts it if a transaction is free.
func (g *grouper) expire(grp *group) {
	g.mu.Lock()
	grp.waited = true
	grp.timer = nil
	starts := g.startLocked()
	g.mu.Unlock()
	g.launch(starts)
}

// startLocked takes the groups that may start now: ready ones first, then the open groups when
// they are done waiting, or when they have waited for a transaction to be free (their members
// came while every transaction was busy). It counts them as running.
func (g *grouper) startLocked() toStart {
	var starts toStart
	for g.running < g.cfg.concurrency {
		var grp *group
		// The first ready group that need not wait for a running one (GroupOffsets: a group
		// runs after the running one that holds a partition of its): one that waited would hold
		// a transaction while groups of other partitions could run in it.
		if i := slices.IndexFunc(g.ready, func(r *group) bool { return !g.waitsLocked(r) }); i >= 0 {
			grp = g.ready[i]
			g.ready = slices.Delete(g.ready, i, i+1)
		} else {
			for range g.opens {
				i := g.nextOpen
				g.nextOpen = (g.nextOpen + 1) % len(g.opens)
				if open := g.opens[i]; open != nil && len(open.members) > 0 && open.waited && !g.waitsLocked(open) {
					grp = open
					g.opens[i] = nil
					g.stopTimer(grp)
					break
				}
			}
			if grp == nil {
				return starts
			}
		}
		g.running++
		g.lastSize = len(grp.members)
		if g.positions != nil {
			g.orderLocked(grp)
		}
		g.setLaneBusyLocked(grp.lane, true)
		starts.add(grp)
	}
	// Every transaction is busy: the open group collects until one is free, and starts then
	// without waiting further.
	for _, open := range g.opens {
		if open != nil {
			g.stopTimer(open)
			open.waited = true
		}
	}
	return starts
}

func (g *grouper) stopTimer(grp *group) {
	if grp.timer != nil {
		grp.timer.Stop()
		grp.timer = nil
	}
}

// toStart is the groups that may start now: most often one or none, which takes no slice.
type toStart struct {
	first *group
	more  []*group
}

func (s *toStart) add(grp *group) {
	if s.first == nil {
		s.first = grp
		return
	}
	s.more = append(s.more, grp)
}

// take returns the first group and leaves the others.
func (s *toStart) take() *group {
	grp := s.first
	if len(s.more) > 0 {
		s.first, s.more = s.more[0], s.more[1:]
	} else {
		s.first = nil
	}
	return grp
}

// launch starts a goroutine for each group of s.
func (g *grouper) launch(s toStart) {
	for grp := s.take(); grp != nil; grp = s.take() {
		go g.runner(grp)
	}
}

// runner runs grp, and then, one after the other, the groups that may start as each group
// before has finished, as long as there are any: under load, a group's goroutine goes on with
// the next group on a stack grown to the depth of the chain already, where a new goroutine
// would start small and grow again. The other groups that may start get goroutines of their
// own.
func (g *grouper) runner(grp *group) {
	for grp != nil {
		grp = g.runThenNext(grp)
	}
}

// runThenNext runs grp, records its end and returns the next group for this goroutine to run,
// or nil. The members of grp that joined by Join get their results in a goroutine of their own,
// once the next groups have started: acknowledging them does not hold up the next transaction.
// Should the goroutine end inside (runtime.Goexit in a processor), the groups that may start go
// to goroutines of their own.
func (g *grouper) runThenNext(grp *group) (next *group) {
	returned := false
	var joined []*member
	defer func() {
		g.mu.Lock()
		if g.positions != nil {
			g.endedLocked(grp)
		}
		g.setLaneBusyLocked(grp.lane, false)
		g.running--
		starts := g.startLocked()
		g.mu.Unlock()
		if returned {
			next = starts.take()
		}
		g.launch(starts)
		if len(joined) > 0 {
			go notifyJoined(joined)
		}
	}()
	for _, before := range grp.after {
		<-before.done
	}
	joined = g.run(grp.members)
	returned = true
	return nil
}

// leave takes m, which has left, out of the group it waits in if that has not started.
func (g *grouper) leave(m *member) {
	g.mu.Lock()
	defer g.mu.Unlock()
	remove := func(grp *group) bool {
		for i, other := range grp.members {
			if other == m {
				grp.members = append(grp.members[:i], grp.members[i+1:]...)
				return true
			}
		}
		return false
	}
	for i, open := range g.opens {
		if open != nil && remove(open) {
			if len(open.members) == 0 {
				g.stopTimer(open)
				g.opens[i] = nil
			}
			return
		}
	}
	for i, grp := range g.ready {
		if remove(grp) {
			if len(grp.members) == 0 {
				g.ready = append(g.ready[:i], g.ready[i+1:]...)
			}
			return
		}
	}
}

// Joiner is the processor that a group transaction (New) makes of the rest
// of the chain, seen from the consumer that runs the chain: besides Process, which a delivery's
// goroutine calls and which waits for the group's outcome, it takes messages by Join, which
// waits for nothing. A consumer that joins a message directly runs what the interceptors
// before the group interceptor would run itself; for a first delivery that succeeds, or is a
// duplicate, that is only what the observers among them do (Observer). When Join's result is
// anything else, the consumer runs the delivery through those interceptors after all (retry,
// dead-letter, recover), with AfterJoin, so that they act on that result as on any attempt's.
type Joiner interface {
	processor.Processor
	Join(ctx context.Context, msg *messagedata.MessageData, lane int, slot *Slot, done Joined)
}

// Joined receives the result of a message that joined a group by Joiner.Join. (An interface,
// not a function: a consumer's state of the delivery receives it without a function value
// made for each.)
type Joined interface {
	Joined(err error)
}

// JoinedFunc makes a function a Joined.
type JoinedFunc func(err error)

// Joined calls f.
func (f JoinedFunc) Joined(err error) { f(err) }

var _ Joiner = (*grouper)(nil)

// Process runs msg in a group and returns its result once the outcome of the group's
// transaction is known (see GroupCommit).
func (g *grouper) Process(ctx context.Context, msg *messagedata.MessageData) error {
	return g.process(ctx, msg)
}

// AfterJoin prepares ctx, the context of a delivery whose first attempt ran by Joiner.Join and
// ended with err, for running the delivery through the chain of the Joiner: its group
// interceptor then returns err, once, in place of running that attempt again, so that the
// interceptors before it act on err as on the result of an attempt of their own. ctx must carry
// the delivery's state (the router's); without it AfterJoin does nothing,
// and the chain runs the attempt again.
func AfterJoin(ctx context.Context, err error) {
	if st := delivery.From(ctx); st != nil {
		st.Joined, st.JoinedErr = true, err
	}
}
