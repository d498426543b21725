package kafka

import (
	"context"
	"errors"
	"time"

	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// Timings of a subscription.
const (
	// commitTimeout bounds one offset commit while the subscription runs.
	commitTimeout = 10 * time.Second
	// retryPause is the pause after a failed commit, or a poll that returned only errors,
	// before the next try.
	retryPause = 100 * time.Millisecond
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
	logger watermill.LoggerAdapter

	// ctx ends when the Subscribe context ends or the Subscriber closes; the deliveries'
	// contexts derive from it.
	ctx                context.Context
	cancel             context.CancelCauseFunc
	stopWithSubscriber func() bool

	out chan *message.Message

	// wake, room and commit are signals (capacity 1): the queue has grown, the window has
	// room, a commit mark has moved.
	wake, room, commit chan struct{}

	mu       sync.Mutex
	parts    map[int32]*partition
	queue    []*delivery // waiting to be handed out, in order
	inflight int         // queued or handed out, not settled: the window's use
	timers   map[*time.Timer]struct{}
	done     bool // ending: nothing is queued again

	// commitMu serialises the commits, and a revoke with them, so that no commit of a
	// partition is sent after the partition is revoked.
	commitMu sync.Mutex

	watchers sync.WaitGroup // one per delivery handed out
}

// partition is the books of one partition the subscription owns.
type partition struct {
	id      int32
	gone    bool     // revoked or lost: its deliveries are void
	entries []*entry // not yet below the commit mark, in offset order
	// next and epoch are the offset after the last record taken, and that record's leader
	// epoch: the commit mark when entries is empty.
	next      int64
	epoch     int32
	committed int64 // the last mark committed, -1 for none
	inflight  int   // this partition's share of the window
	live      map[*delivery]struct{}
}

// entry is one record in the books.
type entry struct {
	rec    *kgo.Record // nil once acked
	offset int64
	epoch  int32
	acked  bool
	// deliveries counts this subscription's deliveries of the record.
	deliveries int
	// unknownCount marks a record that a member before this one may have delivered: the
	// first record at a partition's committed offset when the partition is taken.
	unknownCount bool
}

// delivery is one hand-out of an entry.
type delivery struct {
	p       *partition
	e       *entry
	msg     *message.Message
	cancel  context.CancelCauseFunc
	settled bool
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

// take puts the records of one poll in the books and queues them.
func (sub *subscription) take(recs []*kgo.Record) {
	if len(recs) == 0 {
		return
	}
	sub.mu.Lock()
	fresh := false
	for _, r := range recs {
		if sub.parts[r.Partition] == nil {
			fresh = true
			break
		}
	}
	sub.mu.Unlock()
	var committed map[int32]kgo.EpochOffset
	if fresh {
		committed = sub.cl.CommittedOffsets()[sub.topic]
	}

	sub.mu.Lock()
	defer sub.mu.Unlock()
	for _, r := range recs {
		if r.Topic != sub.topic {
			continue
		}
		p := sub.parts[r.Partition]
		first := p == nil
		if first {
			p = &partition{id: r.Partition, committed: -1, live: map[*delivery]struct{}{}}
			if eo, ok := committed[r.Partition]; ok {
				p.committed = eo.Offset
			}
			sub.parts[r.Partition] = p
		} else if r.Offset < p.next {
			continue // taken already
		}
		e := &entry{rec: r, offset: r.Offset, epoch: r.LeaderEpoch}
		// The record at the committed offset is the one a member before may have held
		// unacked when it stopped: its delivery count is unknown.
		e.unknownCount = first && p.committed == r.Offset
		p.entries = append(p.entries, e)
		p.next, p.epoch = r.Offset+1, r.LeaderEpoch
		sub.enqueueLocked(p, e)
	}
	signal(sub.wake)
}

// enqueueLocked queues a hand-out of e; sub.mu is held.
func (sub *subscription) enqueueLocked(p *partition, e *entry) {
	sub.queue = append(sub.queue, &delivery{p: p, e: e})
	p.inflight++
	sub.inflight++
}

// send hands out the queued deliveries in order until the context ends.
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
		d.e.deliveries++
		info := redelivery.Info{DelaysNacks: true}
		if d.e.unknownCount {
			// Count 0 with Redelivered: the router counts this record's deliveries durably.
			info.Redelivered = true
		} else {
			info.Count = d.e.deliveries
		}
		ctx, cancel := context.WithCancelCause(sub.ctx)
		d.msg = Message(d.e.rec)
		d.msg.SetContext(redelivery.NewContext(ctx, info))
		d.cancel = cancel
		d.p.live[d] = struct{}{}
		sub.mu.Unlock()

		select {
		case sub.out <- d.msg:
			sub.watchers.Add(1)
			go sub.watch(d, ctx)
		case <-ctx.Done():
			// Revoked or ending before it was handed out.
			sub.mu.Lock()
			delete(d.p.live, d)
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
		}
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
	delete(p.live, d)
	p.inflight--
	sub.inflight--
	signal(sub.room)
	if ack {
		d.e.acked, d.e.rec = true, nil
		n := 0
		for n < len(p.entries) && p.entries[n].acked {
			p.entries[n] = nil
			n++
		}
		p.entries = p.entries[n:]
		if n > 0 {
			signal(sub.commit)
		}
		return
	}
	if sub.done {
		return
	}
	e := d.e
	if delay <= 0 {
		sub.enqueueLocked(p, e)
		signal(sub.wake)
		return
	}
	var t *time.Timer
	t = time.AfterFunc(delay, func() {
		sub.mu.Lock()
		defer sub.mu.Unlock()
		delete(sub.timers, t)
		if !p.gone && !sub.done {
			sub.enqueueLocked(p, e)
			signal(sub.wake)
		}
	})
	sub.timers[t] = struct{}{}
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

// commitMarks commits the marks that moved, of the partitions ids (all when ids is nil).
// With drop, it then takes those partitions out of the books: their deliveries end with
// ErrRevoked.
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
	offsets := map[int32]kgo.EpochOffset{}
	for _, p := range parts {
		if m := p.mark(); m.Offset > p.committed {
			offsets[p.id] = m
		}
	}
	sub.mu.Unlock()

	var err error
	if len(offsets) > 0 {
		err = sub.commitOffsets(ctx, offsets)
	}
	sub.mu.Lock()
	defer sub.mu.Unlock()
	if err == nil {
		for _, p := range parts {
			if m, ok := offsets[p.id]; ok && m.Offset > p.committed {
				p.committed = m.Offset
			}
		}
	}
	if drop {
		sub.dropLocked(parts)
	}
	return err
}

// commitOffsets commits offsets of the subscription's topic and waits for the reply.
func (sub *subscription) commitOffsets(ctx context.Context, offsets map[int32]kgo.EpochOffset) error {
	var rerr error
	sub.cl.CommitOffsetsSync(ctx, map[string]map[int32]kgo.EpochOffset{sub.topic: offsets},
		func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
			if err != nil {
				rerr = err
				return
			}
			for _, t := range resp.Topics {
				for _, p := range t.Partitions {
					if err := kerr.ErrorForCode(p.ErrorCode); err != nil && rerr == nil {
						rerr = err
					}
				}
			}
		})
	return rerr
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
		clear(p.live)
		p.entries = nil
		delete(sub.parts, p.id)
	}
	signal(sub.room)
}

// revoked is kgo's OnPartitionsRevoked: the group takes partitions away (a rebalance, or the
// member leaving). It commits what is acked of them and drops the rest from the books, for
// their new owner to deliver again.
func (sub *subscription) revoked(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	ids := lost[sub.topic]
	if len(ids) == 0 {
		return
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
