package kafka

import (
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
// per partition, hands them out in an order of its own (handout.go), and commits the acked
// prefix of each partition (commits).
//
// The books: for each partition it owns, the records taken and not yet below the commit mark,
// in offset order (partition.entries). An entry leaves them when it and every entry before it
// are acked; a nacked entry stays (holding back the mark) and is queued again after its delay.
type subscription struct {
	s     *Subscriber
	topic string
	// prefetch is the subscription's window (Config.Prefetch, or inflight.Rules.Window).
	prefetch int
	cl       *kgo.Client
	adm      *kadm.Client
	logger   watermill.LoggerAdapter
	sub      *inflight.Subscription[*delivery]
	loops    sync.WaitGroup // commits, until the subscription begins to stop (sub.Context)

	// positions are the consumer's applied offsets (redelivery.WithPositions): each
	// partition's records are then handed out in order (readyLocked), several at once with
	// window (redelivery.WithPositionWindow, releaseLocked), and each partition starts after
	// the offset applied there (startOffsets).
	positions redelivery.Positions
	window    bool

	// commit is a signal (capacity 1): a commit mark has moved.
	commit chan struct{}

	mu      sync.Mutex
	parts   map[int32]*partition
	queue   []*delivery // waiting to be handed out, in order
	topicID [16]byte    // the topic's id, from the fetches, for the commits (OffsetCommit v10)
	// The hand-out gate (see pumpLocked): the deliveries in flight, and those of them out
	// alone; gated is set while the head of the queue waits at the gate; atGate is the last
	// delivery that came to it, lateAt when its wait ends, and the timer late pumps then.
	live, alone int
	gated       bool
	atGate      *delivery
	lateAt      time.Time
	late        *time.Timer

	// commitMu serialises the commits, and a revoke with them, so that no commit of a
	// partition is sent after the partition is revoked.
	commitMu sync.Mutex
}

// delivery is one hand-out of an entry, from its queueing to its settlement.
type delivery struct {
	p *partition
	e *entry
	// live is set while the delivery is in flight (emitted, not ended), alone if it was
	// handed out alone (see pumpLocked).
	live, alone bool
	// kept is set while the delivery holds a place of the window that Fetch kept for it
	// (partition.kept counts them); it gives it to the engine when it is emitted.
	kept bool
}

func newSubscription(s *Subscriber, topic string, prefetch int) *subscription {
	sub := &subscription{
		s:        s,
		topic:    topic,
		prefetch: prefetch,
		logger:   s.cfg.log.With(watermill.LogFields{"consumer_group": s.cfg.ConsumerGroup, "topic": topic}),
		commit:   make(chan struct{}, 1),
		parts:    map[int32]*partition{},
	}
	sub.late = time.AfterFunc(aloneWait, func() {
		sub.mu.Lock()
		defer sub.mu.Unlock()
		if sub.gated {
			sub.pumpLocked()
		}
	})
	sub.late.Stop()
	return sub
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

// take puts the records of one poll in the books (see Delivery counts in the package
// documentation): a partition new to the books starts from the group's committed offset and
// metadata, the records below its taken offset being of unknown count (a record that killed
// its consumer among them) and those in its acked spans booked as acked, not delivered. The
// records below the partition's horizon are queued; the others wait for the commit that
// raises it.
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
			p = &partition{id: r.Partition, committed: -1}
			if g, ok := starts[r.Partition]; ok && g.committed >= 0 {
				p.committed = g.committed
				p.unknownUntil = max(g.md.taken, g.takenAtLeast())
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
		sub.pumpLocked()
	}
	if waiting {
		inflight.Signal(sub.commit)
	}
}

// Settle books how a delivery ended. An ack marks its entry acked: the partition's commit mark
// may move, and in order the next record may go out. A nack leaves the deliveries in flight as
// its hold begins (Outcome.Held), and is queued again when the hold ends; a delivery whose
// AckTimeout passed is queued again at once. One that ended with the subscription, or with its
// partition, leaves its entry unacked, for the next owner.
func (sub *subscription) Settle(x *inflight.Delivery[*delivery], o inflight.Outcome) {
	d := x.Data
	p := d.p
	sub.mu.Lock()
	defer sub.mu.Unlock()
	sub.unliveLocked(d)
	if p.gone {
		return
	}
	if o.Acked {
		d.e.acked, d.e.rec = true, nil
		p.popAcked()
		p.acks++
		inflight.Signal(sub.commit)
		if sub.positions != nil && sub.releaseLocked(p) {
			sub.pumpLocked()
		}
		return
	}
	d.e.out = false
	if !o.Nacked && o.HandedOut.IsZero() {
		d.e.deliveries-- // the consumer never took it: withdrawn, or ended with the subscription
	}
	again := o.Cause == nil && o.Nacked && !o.Held || errors.Is(o.Cause, ErrAckTimeout)
	if !again || sub.sub.Stopped() || p.revoking {
		return
	}
	if _, queued := sub.queueLocked(p, d.e); queued {
		sub.pumpLocked()
	} else {
		inflight.Signal(sub.commit) // it waits for the commit that records it
	}
}

// Close runs once the engine has told every delivery how it ended: it waits for the commits
// to stop, commits what is acked and drops the books (release), and leaves the group, so that
// its partitions move at once.
func (sub *subscription) Close(ctx context.Context) error {
	sub.loops.Wait()
	if err := sub.release(ctx, nil, true); err != nil {
		sub.logger.Error("Cannot commit the offsets of the acked records on close: the group delivers them again", err, nil)
	}
	sub.cl.Close() // leaving the group revokes the partitions, which are out of the books
	return nil
}
