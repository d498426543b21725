package kafka

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/messagedata"
)

// Timings of a subscription.
const (
	// commitTimeout bounds one offset commit while the subscription runs.
	commitTimeout = 10 * time.Second
	// retryPause is the pause after a failed commit, or a poll that returned only errors,
	// before the next try.
	retryPause = 100 * time.Millisecond
	// rebalanceSlack is what the group's rebalance timeout allows a member beyond its revoke
	// (Config.RevokeTimeout, a commit in flight, the revoke's own commit): its rejoin.
	rebalanceSlack = 5 * time.Second
)

// subscription is one Subscribe call: one member of the consumer group, which polls records
// while its window has room, hands them out, and commits the acked prefix of each partition.
//
// The books: for each partition it owns, the records taken from the polls and not yet below
// the commit mark, in offset order (entries). An entry leaves the books when it and every
// entry before it are acked; the commit mark is then the offset of the first entry left, or
// the offset after the last record taken. A nacked entry stays in the books (holding back the
// mark) and is queued again after its delay, while the entries behind it go on.
type subscription struct {
	s      *Subscriber
	topic  string
	cl     *kgo.Client
	adm    *kadm.Client
	logger watermill.LoggerAdapter

	// ctx ends when the Subscribe context ends or the Subscriber closes; the deliveries'
	// contexts derive from it.
	ctx                context.Context
	cancel             context.CancelCauseFunc
	stopWithSubscriber func() bool

	out chan *message.Message

	// positions are the consumer's applied offsets, when it gave them on the Subscribe
	// context (redelivery.WithPositions): the subscription then hands out each partition's
	// records in order, one at a time (see readyLocked), and starts each partition it is
	// assigned after the offset applied there (startOffsets). With window
	// (redelivery.WithPositionWindow), several of a partition's records are handed out at
	// once, still in order (see releaseLocked).
	positions redelivery.Positions
	window    bool

	// wake, room and commit are signals (capacity 1): the queue has grown, the window has
	// room, a commit mark has moved.
	wake, room, commit chan struct{}

	mu       sync.Mutex
	parts    map[int32]*partition
	queue    []*delivery // waiting to be handed out, in order
	inflight int         // queued or handed out, not settled: the window's use
	timers   map[*time.Timer]struct{}
	topicID  [16]byte // the topic's id, from the fetches, for the commits (OffsetCommit v10)
	done     bool     // ending: nothing is queued again

	// gate is where the subscription hands out its records (see handOutGate).
	gate *handOutGate

	// commitMu serialises the commits, and a revoke with them, so that no commit of a
	// partition is sent after the partition is revoked.
	commitMu sync.Mutex

	// direct is set when the consumer settles each message itself (redelivery.Settle, asked
	// for on the Subscribe context): a delivery is then booked from its settle function, and
	// ends at AckTimeout by a timer, without a goroutine that waits on its channels (watch).
	direct   bool
	watchers sync.WaitGroup // one per delivery handed out and watched
}

// partition is the books of one partition the subscription owns.
type partition struct {
	id   int32
	gone bool // revoked or lost: its deliveries are void
	// revoking is set while a revoke waits for the deliveries handed out to settle: nothing
	// more of the partition is handed out. drained, if not nil, is closed when live empties.
	revoking bool
	drained  chan struct{}
	// unknownUntil is the offset below which a record taken may have been delivered by a
	// member that owned the partition before: see take.
	unknownUntil int64
	// horizon is the taken offset that the group has in its committed metadata: the first
	// deliveries of the records below it may be handed out. want is the taken offset the
	// sender asks the next commit for. pending are the redeliveries waiting for a commit to
	// record them (see ready).
	horizon int64
	want    int64
	pending []*delivery
	// inherited are the acked spans of the member before (see metadata.go): records in them
	// are taken as acked, not delivered.
	inherited []span
	// acks counts the acks booked, ackCommitted those that a commit has carried.
	acks, ackCommitted int
	entries            []*entry // not yet below the commit mark, in offset order
	// next and epoch are the offset after the last record taken, and that record's leader
	// epoch: the commit mark when entries is empty.
	next      int64
	epoch     int32
	committed int64 // the last mark committed, -1 for none
	inflight  int   // this partition's share of the window
	live      map[*delivery]struct{}
	// held are, in a subscription that hands out records in order, the hand-outs ready to
	// queue that wait for the records before them to be acked, in offset order.
	held []*delivery
}

// entry is one record in the books.
type entry struct {
	rec    *kgo.Record // nil once acked
	offset int64
	epoch  int32
	acked  bool
	// deliveries counts this subscription's deliveries of the record.
	deliveries int
	// unknownCount marks a record that a member before this one may have been delivering
	// when it stopped (see take): it is handed out alone.
	unknownCount bool
	// recorded is how many hand-outs of the record the group's committed metadata covers
	// (see ready).
	recorded int
	waiting  bool // its next hand-out waits in pending for a commit
	// out is set, in a subscription that hands out records in order, while a hand-out of the
	// record is queued or handed out and not settled.
	out bool
}

// delivery is one hand-out of an entry.
type delivery struct {
	p       *partition
	e       *entry
	msg     *message.Message
	cancel  context.CancelCauseFunc
	settled bool
	alone   bool // handed out alone by its subscription (see handOutGate)
	// timer ends the delivery at AckTimeout, in a subscription whose consumer settles
	// directly.
	timer *time.Timer
}

func newSubscription(s *Subscriber, topic string, ctx context.Context, cancel context.CancelCauseFunc) *subscription {
	return &subscription{
		s:      s,
		topic:  topic,
		logger: s.logger.With(watermill.LogFields{"topic": topic}),
		ctx:    ctx,
		cancel: cancel,
		out:    make(chan *message.Message),
		wake:   make(chan struct{}, 1),
		room:   make(chan struct{}, 1),
		commit: make(chan struct{}, 1),
		parts:  map[int32]*partition{},
		gate:   &handOutGate{changed: make(chan struct{})},
		timers: map[*time.Timer]struct{}{},
	}
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// run polls until the subscription's context ends, then winds the subscription down: it
// waits for the deliveries handed out (an ack given before counts), commits what is acked,
// leaves the group and closes the channel.
func (sub *subscription) run() {
	defer sub.s.subs.Done()
	defer close(sub.out)
	defer sub.stopWithSubscriber()

	var helpers sync.WaitGroup
	helpers.Go(sub.send)
	helpers.Go(sub.commits)
	sub.poll()
	helpers.Wait()
	sub.watchers.Wait()
	if sub.direct {
		sub.settleAcked()
	}
	sub.mu.Lock()
	sub.done = true
	for t := range sub.timers {
		t.Stop()
	}
	sub.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), sub.s.cfg.CloseTimeout)
	defer cancel()
	if err := sub.commitMarks(ctx, nil, false); err != nil {
		sub.logger.Error("Cannot commit the offsets of the acked records on close: the group delivers them again", err, nil)
	}
	sub.cl.Close()
	sub.mu.Lock()
	sub.dropLocked(slices.Collect(maps.Values(sub.parts)))
	sub.mu.Unlock()
}

// poll takes records into the books while the window has room, until the context ends.
func (sub *subscription) poll() {
	prefetch := sub.s.cfg.Prefetch
	for sub.ctx.Err() == nil {
		sub.mu.Lock()
		room := prefetch - sub.inflight
		sub.mu.Unlock()
		if room <= 0 {
			select {
			case <-sub.room:
			case <-sub.ctx.Done():
			}
			continue
		}
		fetches := sub.cl.PollRecords(sub.ctx, room)
		if fetches.IsClientClosed() {
			sub.cl.AllowRebalance()
			return
		}
		failed := false
		fetches.EachError(func(topic string, p int32, err error) {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return
			}
			failed = true
			sub.logger.Error("Fetch failed", err, watermill.LogFields{"partition": p})
		})
		fetches.EachTopic(func(t kgo.FetchTopic) {
			if t.Topic == sub.topic && t.TopicID != [16]byte{} {
				sub.mu.Lock()
				sub.topicID = t.TopicID
				sub.mu.Unlock()
			}
		})
		recs := fetches.Records()
		sub.take(recs)
		sub.cl.AllowRebalance()
		if failed && len(recs) == 0 {
			select {
			case <-time.After(retryPause):
			case <-sub.ctx.Done():
			}
		}
	}
}

// take puts the records of one poll in the books. Those below the partition's horizon are
// queued; the others wait for the commit that raises it.
//
// Kafka keeps no delivery count, and a member cannot see which records the member before it
// handed out. So a record is handed out only once the group's committed metadata of its
// partition (metadata.go) says it was taken: a member that takes a partition over knows that
// the records from the committed offset up to that offset may have been delivered before, a
// record that killed its consumer among them, and marks them as of unknown count; the
// records the metadata says were acked are booked as acked and not delivered. Where the
// metadata is not onceflow's (a group committed by another client), the record at the
// committed offset alone is of unknown count.
func (sub *subscription) take(recs []*kgo.Record) {
	if len(recs) == 0 {
		return
	}
	sub.mu.Lock()
	var fresh []int32
	for _, r := range recs {
		if r.Topic == sub.topic && sub.parts[r.Partition] == nil && !slices.Contains(fresh, r.Partition) {
			fresh = append(fresh, r.Partition)
		}
	}
	sub.mu.Unlock()
	starts := map[int32]groupOffset{}
	if len(fresh) > 0 {
		starts = sub.groupOffsets(fresh)
	}

	sub.mu.Lock()
	defer sub.mu.Unlock()
	queued, waiting := false, false
	for _, r := range recs {
		if r.Topic != sub.topic {
			continue
		}
		p := sub.parts[r.Partition]
		if p == nil {
			p = &partition{id: r.Partition, committed: -1, live: map[*delivery]struct{}{}}
			if g, ok := starts[r.Partition]; ok && g.committed >= 0 {
				p.committed = g.committed
				p.unknownUntil = max(g.md.taken, g.committed+1)
				p.horizon = p.unknownUntil
				for _, sp := range g.md.acked {
					if sp.to >= g.committed {
						p.inherited = append(p.inherited, span{max(sp.from, g.committed), sp.to})
					}
				}
			}
			sub.parts[r.Partition] = p
		} else if r.Offset < p.next {
			continue // taken already
		}
		p.next, p.epoch = r.Offset+1, r.LeaderEpoch
		if contains(p.inherited, r.Offset) {
			// Acked by the member before, behind a record that was not.
			p.entries = append(p.entries, &entry{offset: r.Offset, epoch: r.LeaderEpoch, acked: true})
			if p.popAcked() > 0 {
				waiting = true // the mark moved
			}
			continue
		}
		e := &entry{rec: r, offset: r.Offset, epoch: r.LeaderEpoch}
		if n := starts[r.Partition].md.counts[r.Offset]; n > 0 {
			e.deliveries, e.recorded, e.unknownCount = n, n, true
		} else if r.Offset < p.unknownUntil {
			// Taken by a member before: handed out once, or waiting to be.
			e.deliveries, e.recorded, e.unknownCount = 1, 1, true
		}
		p.entries = append(p.entries, e)
		if sub.queueLocked(p, e) {
			queued = true
		} else {
			waiting = true
		}
	}
	_ = waiting
	if queued {
		signal(sub.wake)
	}
	if waiting {
		signal(sub.commit)
	}
}

// groupOffset is what the group has committed for a partition.
type groupOffset struct {
	committed int64 // -1 for nothing
	md        groupMetadata
}

// groupOffsets fetches the group's committed offsets and metadata of the partitions ids. On
// failure it falls back to what the client fetched when the partitions were assigned, without
// metadata.
func (sub *subscription) groupOffsets(ids []int32) map[int32]groupOffset {
	out := map[int32]groupOffset{}
	ctx, cancel := context.WithTimeout(sub.ctx, commitTimeout)
	defer cancel()
	resp, err := sub.adm.FetchOffsetsForTopics(ctx, sub.s.cfg.ConsumerGroup, sub.topic)
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		sub.logger.Error("Cannot fetch the group's offsets: counting as redelivered only the record at each committed offset", err, nil)
		for p, eo := range sub.cl.CommittedOffsets()[sub.topic] {
			out[p] = groupOffset{committed: eo.Offset}
		}
		return out
	}
	for _, id := range ids {
		o, ok := resp.Lookup(sub.topic, id)
		if !ok || o.At < 0 {
			continue
		}
		g := groupOffset{committed: o.At}
		g.md, _ = parseMetadata(o.Metadata)
		out[id] = g
	}
	return out
}

// startOffsets is kgo's AdjustFetchOffsetsFn of a subscription whose consumer gave its
// positions: each partition assigned starts after the offset the consumer applied last there,
// when the group's committed offset is below it, so that the records at or below it are not
// fetched again. When the positions cannot be read, the partitions start at the committed
// offsets: the consumer's duplicate detection absorbs what it applied already.
func (sub *subscription) startOffsets(ctx context.Context, offsets map[string]map[int32]kgo.Offset) (map[string]map[int32]kgo.Offset, error) {
	parts := offsets[sub.topic]
	if len(parts) == 0 {
		return offsets, nil
	}
	ctx, cancel := context.WithTimeout(ctx, commitTimeout)
	defer cancel()
	applied, err := sub.positions.Applied(ctx, sub.topic)
	if err != nil {
		sub.logger.Error("Cannot read the consumer's positions: its partitions start at the group's committed offsets", err, nil)
		return offsets, nil
	}
	for id, o := range parts {
		// A partition without a commit starts at its first record: an offset below 0.
		if a, ok := applied[id]; ok && o.EpochOffset().Offset <= a {
			parts[id] = kgo.NewOffset().At(a + 1)
		}
	}
	return offsets, nil
}

// queueLocked queues the next hand-out of e if the group's metadata covers it (ready), and
// otherwise puts it with the deliveries that wait for the next commit; it reports whether it
// queued it. sub.mu is held.
func (sub *subscription) queueLocked(p *partition, e *entry) bool {
	d := &delivery{p: p, e: e}
	p.inflight++
	sub.inflight++
	if p.ready(e) {
		return sub.readyLocked(d)
	}
	e.waiting = true
	p.pending = append(p.pending, d)
	return false
}

// readyLocked queues d, whose hand-out is ready, and reports whether the queue grew. A
// subscription that hands out records in order (positions) holds it instead until every
// record before it in its partition is acked (releaseLocked). sub.mu is held.
func (sub *subscription) readyLocked(d *delivery) bool {
	if sub.positions == nil {
		sub.queue = append(sub.queue, d)
		return true
	}
	p := d.p
	i, _ := slices.BinarySearchFunc(p.held, d.e.offset, func(h *delivery, o int64) int { return cmp.Compare(h.e.offset, o) })
	p.held = slices.Insert(p.held, i, d)
	return sub.releaseLocked(p)
}

// releaseLocked queues the hand-outs held for p whose turn it is, and reports whether the
// queue grew. One at a time, that is the hand-out of p's first record not acked: every other
// record of p is either acked, or behind it, so at most one record of p is queued or handed
// out at once. With a window, it is each held hand-out in order as long as p.inOrder allows
// it. sub.mu is held.
func (sub *subscription) releaseLocked(p *partition) bool {
	grew := false
	for len(p.held) > 0 && len(p.entries) > 0 {
		h := p.held[0]
		if sub.window && !p.inOrder(h.e) || !sub.window && h.e != p.entries[0] {
			break
		}
		h.e.out = true
		sub.queue = append(sub.queue, h)
		p.held[0] = nil
		p.held = p.held[1:]
		grew = true
	}
	return grew
}

// inOrder reports whether a hand-out of e may be queued in a subscription with a window: a
// first one when every record before e that is not acked is out (queued or handed out), so
// that the consumer has them all, in order; a redelivery when every record before e is acked,
// so that a nacked record comes again before the ones behind it, which wait for it (their
// predecessor failed: they would fail behind it again).
func (p *partition) inOrder(e *entry) bool {
	for _, x := range p.entries {
		switch {
		case x == e:
			return true
		case x.acked:
		case e.deliveries > 0 || !x.out:
			return false
		}
	}
	return false
}

// enqueueLocked queues the next hand-out of e, or has it wait for the next commit, and
// signals whichever applies; sub.mu is held.
func (sub *subscription) enqueueLocked(p *partition, e *entry) {
	if sub.queueLocked(p, e) {
		signal(sub.wake)
	} else {
		signal(sub.commit)
	}
}

// ready reports whether e's next hand-out may be queued: a first one always (the sender
// waits for the taken offset to pass it, see send), the n-th (n >= 2) once the group's
// committed metadata records n, so that a member that takes the partition over after it sees
// the hand-out.
func (p *partition) ready(e *entry) bool {
	return e.deliveries == 0 || e.recorded > e.deliveries
}

// counts returns the hand-outs to record of the unacked entries handed out or to be handed
// out more than once (a first hand-out is recorded by the taken offset), and whether one of
// them is more than the metadata has.
func (p *partition) counts() (map[int64]int, bool) {
	var out map[int64]int
	grew := false
	for _, e := range p.entries {
		n := e.deliveries
		if e.waiting {
			n++ // its next hand-out waits to be recorded
		}
		if e.acked || n < 2 {
			continue
		}
		if out == nil {
			out = map[int64]int{}
		}
		out[e.offset] = n
		grew = grew || n > e.recorded
	}
	return out, grew
}

// send hands out the queued deliveries in order until the context ends.
//
// A record that a member before may have been delivering when it stopped (unknownCount) is
// handed out alone (see handOutGate): if it is a message that kills its consumer, the
// subscription's other records do not die with it, and are not counted with it towards their
// delivery limits.
func (sub *subscription) send() {
	for {
		sub.mu.Lock()
		for len(sub.queue) == 0 {
			sub.mu.Unlock()
			select {
			case <-sub.wake:
			case <-sub.ctx.Done():
				return
			}
			sub.mu.Lock()
		}
		d := sub.queue[0]
		sub.queue[0] = nil
		sub.queue = sub.queue[1:]
		if d.p.gone {
			sub.mu.Unlock()
			continue
		}
		if d.p.revoking {
			d.p.inflight--
			sub.inflight--
			sub.mu.Unlock()
			continue
		}
		if d.e.deliveries == 0 && d.e.offset >= d.p.horizon {
			// A first hand-out: the group's metadata must say it was taken first. Ask the
			// next commit to cover it and the first hand-outs queued behind it.
			sub.queue = slices.Insert(sub.queue, 0, d)
			sub.wantLocked()
			sub.mu.Unlock()
			signal(sub.commit)
			select {
			case <-sub.wake:
			case <-sub.ctx.Done():
				return
			}
			continue
		}
		d.alone = d.e.unknownCount
		sub.mu.Unlock()
		if !sub.gate.enter(sub.ctx, d.alone) {
			return
		}
		sub.mu.Lock()
		if d.p.gone || d.p.revoking {
			// Revoked while it waited at the gate.
			sub.gate.leave(d.alone)
			if !d.p.gone {
				d.p.inflight--
				sub.inflight--
			}
			sub.mu.Unlock()
			continue
		}
		d.e.deliveries++
		info := redelivery.Info{Count: d.e.deliveries, DelaysNacks: true}
		ctx, cancel := context.WithCancelCause(sub.ctx)
		d.msg = Message(d.e.rec)
		messagedata.Position{Partition: d.e.rec.Partition, Offset: d.e.offset, Previous: d.p.previous(d.e)}.SetHeaders(d.msg.Metadata)
		msgCtx := ctx
		if sub.direct {
			msgCtx = redelivery.NewSettleContext(ctx, func() { sub.settled(d) })
		}
		d.msg.SetContext(redelivery.NewContext(msgCtx, info))
		d.cancel = cancel
		d.p.live[d] = struct{}{}
		sub.mu.Unlock()

		select {
		case sub.out <- d.msg:
			if !sub.direct {
				sub.watchers.Add(1)
				go sub.watch(d, ctx)
				break
			}
			// AckTimeout counts from the hand-out, as in watch; the consumer may have
			// settled the delivery already.
			sub.mu.Lock()
			if !d.settled && !d.p.gone {
				d.timer = time.AfterFunc(sub.s.cfg.AckTimeout, func() { sub.settle(d, false, 0, ErrAckTimeout) })
			}
			sub.mu.Unlock()
		case <-ctx.Done():
			// Revoked or ending before it was handed out.
			sub.mu.Lock()
			sub.unliveLocked(d)
			sub.mu.Unlock()
		}
	}
}

// watch waits for the settlement of one delivery.
func (sub *subscription) watch(d *delivery, ctx context.Context) {
	defer sub.watchers.Done()
	defer d.cancel(nil)
	timer := time.NewTimer(sub.s.cfg.AckTimeout)
	defer timer.Stop()
	select {
	case <-d.msg.Acked():
		sub.settle(d, true, 0, nil)
	case <-d.msg.Nacked():
		delay := sub.s.cfg.NackDelay
		if rd, ok := redelivery.RequestedDelay(d.msg.Context()); ok {
			delay = rd
		}
		sub.settle(d, false, delay, nil)
	case <-timer.C:
		sub.settle(d, false, 0, ErrAckTimeout)
	case <-ctx.Done():
		// An ack given before the delivery ended counts.
		select {
		case <-d.msg.Acked():
			sub.settle(d, true, 0, nil)
		default:
			sub.mu.Lock()
			sub.unliveLocked(d)
			sub.mu.Unlock()
		}
	}
}

// settled is the settle function of d in a subscription whose consumer settles directly
// (redelivery.Settle): it books d's ack or nack, then ends the delivery's context.
func (sub *subscription) settled(d *delivery) {
	if redelivery.Acked(d.msg) {
		sub.settle(d, true, 0, nil)
	} else {
		delay := sub.s.cfg.NackDelay
		if rd, ok := redelivery.RequestedDelay(d.msg.Context()); ok {
			delay = rd
		}
		sub.settle(d, false, delay, nil)
	}
	d.cancel(nil)
}

// settleAcked books, in a subscription whose consumer settles directly and that is ending, the
// acks given before the end whose Settle has not come yet: as watch does, an ack given before
// the delivery ended counts.
func (sub *subscription) settleAcked() {
	var acked []*delivery
	sub.mu.Lock()
	for _, p := range sub.parts {
		for d := range p.live {
			if redelivery.Acked(d.msg) {
				acked = append(acked, d)
			}
		}
	}
	sub.mu.Unlock()
	for _, d := range acked {
		sub.settle(d, true, 0, nil)
	}
}

// settle books the ack or nack of d. A nacked record is queued again after delay; cause, if
// not nil, ends the delivery's context first.
func (sub *subscription) settle(d *delivery, ack bool, delay time.Duration, cause error) {
	if cause != nil {
		d.cancel(cause)
	}
	sub.mu.Lock()
	defer sub.mu.Unlock()
	p := d.p
	if d.settled || p.gone {
		return
	}
	d.settled = true
	if d.timer != nil {
		d.timer.Stop()
	}
	sub.unliveLocked(d)
	p.inflight--
	sub.inflight--
	signal(sub.room)
	if ack {
		d.e.acked, d.e.rec = true, nil
		p.popAcked()
		p.acks++
		sub.gate.acked(1)
		signal(sub.commit)
		if sub.positions != nil && sub.releaseLocked(p) {
			signal(sub.wake)
		}
		return
	}
	d.e.out = false
	if sub.done || p.revoking {
		return // it stays unacked: its partition's next owner delivers it again
	}
	e := d.e
	if delay <= 0 {
		sub.enqueueLocked(p, e)
		return
	}
	var t *time.Timer
	t = time.AfterFunc(delay, func() {
		sub.mu.Lock()
		defer sub.mu.Unlock()
		delete(sub.timers, t)
		if !p.gone && !p.revoking && !sub.done {
			sub.enqueueLocked(p, e)
		}
	})
	sub.timers[t] = struct{}{}
}

// wantLocked sets, for the partitions of the first hand-outs at the head of the queue, the
// taken offset the next commit is to record: up to a quarter of the window ahead, and not
// past a record handed out alone (which may kill its consumer: the records behind it must
// not count as handed out with it). sub.mu is held.
func (sub *subscription) wantLocked() {
	ahead := max(sub.s.cfg.Prefetch/4, 1)
	for i, d := range sub.queue {
		if i == ahead || (i > 0 && d.e.unknownCount) {
			return
		}
		if d.e.deliveries == 0 && !d.p.gone {
			d.p.want = max(d.p.want, d.e.offset+1)
		}
		if d.e.unknownCount {
			continue
		}
		// In order, the records held behind it are handed out next, one at a time: one
		// commit covers them too.
		for j, h := range d.p.held {
			if j == ahead || h.e.unknownCount {
				break
			}
			if h.e.deliveries == 0 && !d.p.gone {
				d.p.want = max(d.p.want, h.e.offset+1)
			}
		}
	}
}

// unliveLocked takes d off its partition's deliveries in flight; sub.mu is held.
func (sub *subscription) unliveLocked(d *delivery) {
	p := d.p
	if _, ok := p.live[d]; !ok {
		return
	}
	delete(p.live, d)
	if d.timer != nil {
		d.timer.Stop()
	}
	sub.gate.leave(d.alone)
	if len(p.live) == 0 && p.drained != nil {
		close(p.drained)
		p.drained = nil
	}
}

// previous returns the offset of the last record before e in p's books that is not acked, -1
// for none (messagedata.HeaderPreviousOffset): the record that the consumer has to apply
// before e. The records before e that are acked (processed, duplicates, dead-lettered) or
// below the commit mark need nothing more.
func (p *partition) previous(e *entry) int64 {
	i, _ := slices.BinarySearchFunc(p.entries, e.offset, func(x *entry, o int64) int { return cmp.Compare(x.offset, o) })
	for i--; i >= 0; i-- {
		if !p.entries[i].acked {
			return p.entries[i].offset
		}
	}
	return -1
}

// popAcked takes the acked entries at the front out of the books and returns how many.
func (p *partition) popAcked() int {
	n := 0
	for n < len(p.entries) && p.entries[n].acked {
		p.entries[n] = nil
		n++
	}
	p.entries = p.entries[n:]
	return n
}

// spans returns the acked spans behind the commit mark: those of the books, and those
// inherited that lie beyond the records taken.
func (p *partition) spans() []span {
	var out []span
	open := false
	for _, e := range p.entries {
		switch {
		case !e.acked:
			open = false
		case open:
			out[len(out)-1].to = e.offset
		default:
			out = append(out, span{e.offset, e.offset})
			open = true
		}
	}
	for _, sp := range p.inherited {
		if sp.to >= p.next {
			out = append(out, span{max(sp.from, p.next), sp.to})
		}
	}
	return out
}

// mark returns the commit mark of p: the offset of its first entry not acked, or the offset
// after the last record taken.
func (p *partition) mark() kgo.EpochOffset {
	if len(p.entries) > 0 {
		return kgo.EpochOffset{Epoch: p.entries[0].epoch, Offset: p.entries[0].offset}
	}
	return kgo.EpochOffset{Epoch: p.epoch, Offset: p.next}
}

// commits commits the marks as they move, until the context ends.
func (sub *subscription) commits() {
	for {
		select {
		case <-sub.commit:
		case <-sub.ctx.Done():
			return
		}
		ctx, cancel := context.WithTimeout(sub.ctx, commitTimeout)
		err := sub.commitMarks(ctx, nil, false)
		cancel()
		if err != nil && sub.ctx.Err() == nil {
			sub.logger.Error("Offset commit failed; retrying", err, nil)
			select {
			case <-time.After(retryPause):
				signal(sub.commit)
			case <-sub.ctx.Done():
				return
			}
		}
	}
}

// commitMarks commits, for the partitions ids (all when ids is nil), the marks and the taken
// offsets that moved, and hands out the records that the new taken offsets cover. With drop,
// it then takes those partitions out of the books: their deliveries end with ErrRevoked.
func (sub *subscription) commitMarks(ctx context.Context, ids []int32, drop bool) error {
	sub.commitMu.Lock()
	defer sub.commitMu.Unlock()

	sub.mu.Lock()
	var parts []*partition
	if ids == nil {
		for _, p := range sub.parts {
			parts = append(parts, p)
		}
	} else {
		for _, id := range ids {
			if p := sub.parts[id]; p != nil {
				parts = append(parts, p)
			}
		}
	}
	commits := map[int32]commit{}
	for _, p := range parts {
		c := commit{mark: p.mark(), md: groupMetadata{taken: max(p.want, p.unknownUntil, p.horizon)}, acks: p.acks}
		counts, grew := p.counts()
		if c.mark.Offset > p.committed || c.md.taken > p.horizon || c.acks > p.ackCommitted || grew {
			c.md.acked, c.md.counts = p.spans(), counts
			commits[p.id] = c
		}
	}
	sub.mu.Unlock()

	var err error
	if len(commits) > 0 {
		err = sub.commitOffsets(ctx, commits)
	}
	sub.mu.Lock()
	defer sub.mu.Unlock()
	if err == nil {
		queued := false
		for _, p := range parts {
			c, ok := commits[p.id]
			if !ok || p.gone {
				continue
			}
			p.committed = max(p.committed, c.mark.Offset)
			p.horizon = max(p.horizon, c.md.taken)
			if c.acks > p.ackCommitted {
				sub.gate.acked(-(c.acks - p.ackCommitted))
				p.ackCommitted = c.acks
			}
			for _, e := range p.entries {
				if n, ok := c.md.counts[e.offset]; ok {
					e.recorded = max(e.recorded, n)
				}
			}
			if p.revoking {
				continue
			}
			if c.md.taken > p.horizon-1 {
				queued = true // the sender may wait for it
			}
			kept := p.pending[:0]
			for _, d := range p.pending {
				if p.ready(d.e) {
					d.e.waiting = false
					if sub.readyLocked(d) {
						queued = true
					}
				} else {
					kept = append(kept, d)
				}
			}
			clear(p.pending[len(kept):])
			p.pending = kept
		}
		if queued {
			signal(sub.wake)
		}
	}
	if drop {
		sub.dropLocked(parts)
	}
	return err
}

// commit is what one offset commit says of a partition.
type commit struct {
	mark kgo.EpochOffset
	md   groupMetadata
	acks int // p.acks when it was made
}

// commitOffsets commits the marks of the subscription's topic, with their taken offsets as
// metadata, in the member's current generation, and waits for the reply. A commit that the
// group refuses (a rebalance is under way, the member left) changes nothing.
func (sub *subscription) commitOffsets(ctx context.Context, commits map[int32]commit) error {
	member, generation := sub.cl.GroupMetadata()
	if member == "" {
		return errors.New("kafka: commit: not a member of the group yet")
	}
	req := kmsg.NewPtrOffsetCommitRequest()
	req.Group = sub.s.cfg.ConsumerGroup
	req.MemberID = member
	req.Generation = generation
	t := kmsg.NewOffsetCommitRequestTopic()
	t.Topic = sub.topic
	sub.mu.Lock()
	t.TopicID = sub.topicID
	sub.mu.Unlock()
	for id, c := range commits {
		rp := kmsg.NewOffsetCommitRequestTopicPartition()
		rp.Partition = id
		rp.Offset = c.mark.Offset
		rp.LeaderEpoch = c.mark.Epoch
		md := c.md.encode()
		rp.Metadata = &md
		t.Partitions = append(t.Partitions, rp)
	}
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, sub.cl)
	if err != nil {
		return err
	}
	for _, rt := range resp.Topics {
		for _, rp := range rt.Partitions {
			if err := kerr.ErrorForCode(rp.ErrorCode); err != nil {
				return fmt.Errorf("kafka: commit partition %d: %w", rp.Partition, err)
			}
		}
	}
	return nil
}

// dropLocked takes parts out of the books; sub.mu is held.
func (sub *subscription) dropLocked(parts []*partition) {
	for _, p := range parts {
		if p.gone {
			continue
		}
		p.gone = true
		sub.inflight -= p.inflight
		p.inflight = 0
		for d := range p.live {
			d.cancel(ErrRevoked)
		}
		for d := range p.live {
			if d.timer != nil {
				d.timer.Stop()
			}
			sub.gate.leave(d.alone)
		}
		clear(p.live)
		sub.gate.acked(-(p.acks - p.ackCommitted))
		p.ackCommitted = p.acks
		p.entries, p.pending, p.held = nil, nil, nil
		delete(sub.parts, p.id)
	}
	signal(sub.room)
}

// revoked is kgo's OnPartitionsRevoked: the group takes partitions away (a rebalance, or the
// member leaving). It stops handing out their records, waits up to Config.RevokeTimeout for
// the deliveries in flight to settle, commits what is acked and drops the rest from the books,
// for their new owner to deliver again.
func (sub *subscription) revoked(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	ids := lost[sub.topic]
	if len(ids) == 0 {
		return
	}
	var drained []chan struct{}
	sub.mu.Lock()
	for _, id := range ids {
		p := sub.parts[id]
		if p == nil || p.gone {
			continue
		}
		p.revoking = true
		if len(p.live) > 0 {
			if p.drained == nil {
				p.drained = make(chan struct{})
			}
			drained = append(drained, p.drained)
		}
	}
	sub.mu.Unlock()
	wait := time.NewTimer(sub.s.cfg.RevokeTimeout)
	defer wait.Stop()
waiting:
	for _, ch := range drained {
		select {
		case <-ch:
		case <-wait.C:
			break waiting
		case <-sub.ctx.Done():
			break waiting // the subscription ends: its deliveries end with it
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), sub.s.cfg.CloseTimeout)
	defer cancel()
	if err := sub.commitMarks(ctx, ids, true); err != nil {
		sub.logger.Error("Cannot commit the offsets of revoked partitions: their new owner delivers the acked records again", err, watermill.LogFields{"partitions": ids})
	}
}

// lost is kgo's OnPartitionsLost: the member lost its partitions without a revoke (its
// session expired); a commit would be refused. The books of those partitions are dropped.
func (sub *subscription) lost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	ids := lost[sub.topic]
	if len(ids) == 0 {
		return
	}
	sub.commitMu.Lock()
	defer sub.commitMu.Unlock()
	sub.mu.Lock()
	defer sub.mu.Unlock()
	var parts []*partition
	for _, id := range ids {
		if p := sub.parts[id]; p != nil {
			parts = append(parts, p)
		}
	}
	sub.dropLocked(parts)
	sub.logger.Info("Partitions lost: their records are delivered again by their next owner", watermill.LogFields{"partitions": ids})
}
