package kafka

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker/internal/inflight"
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

// subscription is the Kafka side of one Subscribe call (an inflight.Source): one member of the
// consumer group, which polls records while the engine's window has room (Fetch), books them
// per partition, hands them out in an order of its own (handOut: a record once the group's
// metadata records its hand-out, one at a time in order for a consumer with positions, alone
// when a member before may have been delivering it), and commits the acked prefix of each
// partition (commits). The engine (sub) keeps the window, the deliveries' contexts,
// AckTimeout, direct or watched settlement and the nack holds.
//
// The books: for each partition it owns, the records taken from the polls and not yet below
// the commit mark, in offset order (entries). An entry leaves the books when it and every
// entry before it are acked; the commit mark is then the offset of the first entry left, or
// the offset after the last record taken. A nacked entry stays in the books (holding back the
// mark) and is queued again after its delay, while the entries behind it go on.
type subscription struct {
	s     *Subscriber
	topic string
	// prefetch is the subscription's window: Config.Prefetch, or when left unset the window
	// its consumer asked for (inflight.Rules.Window).
	prefetch int
	cl       *kgo.Client
	adm      *kadm.Client
	logger   watermill.LoggerAdapter
	sub      *inflight.Subscription[*delivery]

	// ctx ends when the subscription begins to stop: the hand-out and the commits stop, and
	// so do the waits at the gate and for a revoke.
	ctx    context.Context
	cancel context.CancelFunc
	loops  sync.WaitGroup // handOut and commits

	// positions are the consumer's applied offsets, when it gave them on the Subscribe
	// context (redelivery.WithPositions): the subscription then hands out each partition's
	// records in order, one at a time (see readyLocked), and starts each partition it is
	// assigned after the offset applied there (startOffsets). With window
	// (redelivery.WithPositionWindow), several of a partition's records are handed out at
	// once, still in order (see releaseLocked).
	positions redelivery.Positions
	window    bool

	// wake and commit are signals (capacity 1): the queue has grown, a commit mark has moved.
	wake, commit chan struct{}

	mu      sync.Mutex
	parts   map[int32]*partition
	queue   []*delivery // waiting to be handed out, in order
	topicID [16]byte    // the topic's id, from the fetches, for the commits (OffsetCommit v10)
	done    bool        // ending: nothing is queued again

	// gate is where the subscription hands out its records (see handOutGate).
	gate *handOutGate

	// commitMu serialises the commits, and a revoke with them, so that no commit of a
	// partition is sent after the partition is revoked.
	commitMu sync.Mutex
}

// delivery is one hand-out of an entry, from its queueing to its settlement.
type delivery struct {
	p     *partition
	e     *entry
	alone bool // handed out alone by its subscription (see handOutGate)
	// kept is set while the delivery holds a place of the window that Fetch kept for it
	// (partition.kept counts them); it gives it to the engine when it is emitted.
	kept bool
}

func newSubscription(s *Subscriber, topic string, prefetch int) *subscription {
	sub := &subscription{
		s:        s,
		topic:    topic,
		prefetch: prefetch,
		logger:   s.logger.With(watermill.LogFields{"topic": topic}),
		wake:     make(chan struct{}, 1),
		commit:   make(chan struct{}, 1),
		parts:    map[int32]*partition{},
		gate:     &handOutGate{changed: make(chan struct{})},
	}
	sub.ctx, sub.cancel = context.WithCancel(context.Background())
	return sub
}

// start starts the hand-out and the commits, until the subscription begins to stop (or
// cancel is called: it did not start).
func (sub *subscription) start() {
	sub.loops.Add(2)
	go sub.handOut()
	go sub.commits()
	go func() {
		select {
		case <-sub.sub.Stopping():
		case <-sub.ctx.Done():
		}
		sub.mu.Lock()
		sub.done = true
		sub.mu.Unlock()
		sub.cancel()
	}()
}

// Fetch polls up to n records and takes them into the books, keeping a place of the window
// for each record to hand out.
func (sub *subscription) Fetch(ctx context.Context, n int) error {
	fetches := sub.cl.PollRecords(ctx, n)
	if fetches.IsClientClosed() {
		sub.cl.AllowRebalance()
		return errors.New("kafka: the client is closed")
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
	sub.take(ctx, recs)
	sub.cl.AllowRebalance()
	if failed && len(recs) == 0 {
		sub.sub.Sleep(retryPause)
	}
	return nil
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
func (sub *subscription) take(ctx context.Context, recs []*kgo.Record) {
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
		starts = sub.groupOffsets(ctx, fresh)
	}

	sub.mu.Lock()
	defer sub.mu.Unlock()
	queued, waiting := false, false
	var booked []*delivery
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
		d, ready := sub.queueLocked(p, e)
		booked = append(booked, d)
		if ready {
			queued = true
		} else {
			waiting = true
		}
	}
	for _, d := range booked[:sub.sub.Keep(len(booked))] {
		d.kept = true
		d.p.kept++
	}
	if queued {
		inflight.Signal(sub.wake)
	}
	if waiting {
		inflight.Signal(sub.commit)
	}
}

// queueLocked makes the next hand-out of e and queues it if the group's metadata covers it
// (ready), or otherwise puts it with the deliveries that wait for the next commit; it reports
// whether the queue grew. sub.mu is held.
func (sub *subscription) queueLocked(p *partition, e *entry) (*delivery, bool) {
	d := &delivery{p: p, e: e}
	if p.ready(e) {
		return d, sub.readyLocked(d)
	}
	e.waiting = true
	p.pending = append(p.pending, d)
	return d, false
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

// enqueueLocked queues the next hand-out of e, or has it wait for the next commit, and
// signals whichever applies; sub.mu is held.
func (sub *subscription) enqueueLocked(p *partition, e *entry) {
	if _, queued := sub.queueLocked(p, e); queued {
		inflight.Signal(sub.wake)
	} else {
		inflight.Signal(sub.commit)
	}
}

// handOut emits the queued deliveries in order until the subscription begins to stop.
//
// A record that a member before may have been delivering when it stopped (unknownCount) is
// handed out alone (see handOutGate): if it is a message that kills its consumer, the
// subscription's other records do not die with it, and are not counted with it towards their
// delivery limits.
func (sub *subscription) handOut() {
	defer sub.loops.Done()
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
			sub.unkeepLocked(d)
			sub.mu.Unlock()
			continue
		}
		if d.e.deliveries == 0 && d.e.offset >= d.p.horizon {
			// A first hand-out: the group's metadata must say it was taken first. Ask the
			// next commit to cover it and the first hand-outs queued behind it.
			sub.queue = slices.Insert(sub.queue, 0, d)
			sub.wantLocked()
			sub.mu.Unlock()
			inflight.Signal(sub.commit)
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
			sub.unkeepLocked(d)
			sub.mu.Unlock()
			continue
		}
		if !sub.emitLocked(d) {
			sub.mu.Unlock()
			return
		}
		sub.mu.Unlock()
	}
}

// emitLocked gives d to the engine to hand out, with its message and its position, and
// reports false when the subscription is stopping. It is emitted under sub.mu, so that a
// revoke that drops its partition after finds it in the engine. sub.mu is held.
func (sub *subscription) emitLocked(d *delivery) bool {
	d.e.deliveries++
	msg := Message(d.e.rec)
	messagedata.Position{Partition: d.e.rec.Partition, Offset: d.e.offset, Previous: d.p.previous(d.e)}.SetHeaders(msg.Metadata)
	kept := d.kept
	if kept {
		d.kept = false
		d.p.kept--
	}
	d.p.live[d] = struct{}{}
	if sub.sub.Emit(inflight.Item[*delivery]{Data: d, Msg: msg, Count: d.e.deliveries, Kept: kept}) == nil {
		sub.unliveLocked(d)
		return false
	}
	return true
}

// unkeepLocked gives back the place of the window that d holds, if it holds one: it will not
// be handed out (its partition is being revoked). sub.mu is held.
func (sub *subscription) unkeepLocked(d *delivery) {
	if d.kept && !d.p.gone {
		d.kept = false
		d.p.kept--
		sub.sub.Release(1)
	}
}

// wantLocked sets, for the partitions of the first hand-outs at the head of the queue, the
// taken offset the next commit is to record: up to a quarter of the window ahead, and not
// past a record handed out alone (which may kill its consumer: the records behind it must
// not count as handed out with it). sub.mu is held.
func (sub *subscription) wantLocked() {
	ahead := max(sub.prefetch/4, 1)
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
