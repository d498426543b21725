package sqlqueue

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/sqldb"
)

// Coalescing of settlements.
const (
	// settleLinger is how long the first settlement of a batch waits for others before the
	// batch is written: short enough that no prefetch window waits on it, long enough that
	// the acks of a burst of deliveries share one statement.
	settleLinger = 2 * time.Millisecond
	// maxSettleBatch bounds the leases one statement settles.
	maxSettleBatch = 500
)

// pending is the settlements of one topic not yet written. An acknowledgement supersedes a
// lease change of the same lease (a delivery given back at Close, then acked).
type pending struct {
	acks    map[leaseRef]bool
	updates map[leaseRef]leaseUpdate
}

func newPending() *pending {
	return &pending{acks: map[leaseRef]bool{}, updates: map[leaseRef]leaseUpdate{}}
}

func (p *pending) ack(r leaseRef) {
	p.acks[r] = true
	delete(p.updates, r)
}

func (p *pending) update(u leaseUpdate) {
	if !p.acks[u.leaseRef] {
		p.updates[u.leaseRef] = u
	}
}

func (p *pending) merge(o *pending) {
	for r := range o.acks {
		p.ack(r)
	}
	for _, u := range o.updates {
		p.update(u)
	}
}

func (p *pending) len() int { return len(p.acks) + len(p.updates) }

// batches splits p into batches of at most maxSettleBatch leases each, in offset order, so that
// concurrent writers lock leases in the same order.
func (p *pending) batches() []*batch {
	acks := make([]leaseRef, 0, len(p.acks))
	for r := range p.acks {
		acks = append(acks, r)
	}
	updates := make([]leaseUpdate, 0, len(p.updates))
	for _, u := range p.updates {
		updates = append(updates, u)
	}
	slices.SortFunc(acks, func(a, b leaseRef) int { return cmp.Compare(a.offset, b.offset) })
	slices.SortFunc(updates, func(a, b leaseUpdate) int { return cmp.Compare(a.offset, b.offset) })
	var out []*batch
	for len(acks) > 0 || len(updates) > 0 {
		b := &batch{}
		na := min(len(acks), maxSettleBatch)
		b.acks, acks = acks[:na], acks[na:]
		nu := min(len(updates), maxSettleBatch-na)
		b.updates, updates = updates[:nu], updates[nu:]
		out = append(out, b)
	}
	return out
}

// settler writes the settlements of one Subscriber's deliveries: acknowledgements delete the
// lease, nacks and give-backs change it. Settlements that come within settleLinger of each
// other go in one statement per topic. A write that fails is kept and tried again after
// Config.RetryInterval, together with what came since: an acknowledgement is never dropped
// while the Subscriber is open. seal ends it with a last write.
type settler struct {
	q   *Queue
	log watermill.LoggerAdapter

	mu     sync.Mutex
	topics map[string]*pending
	sealed bool

	kick chan struct{} // something was added
	stop chan struct{} // closed by seal
	done chan struct{} // closed when run returns
	err  error         // what the last write left unwritten, set before done closes
}

func newSettler(q *Queue) *settler {
	return &settler{
		q:      q,
		log:    q.cfg.log,
		topics: map[string]*pending{},
		kick:   make(chan struct{}, 1),
		stop:   make(chan struct{}),
		done:   make(chan struct{}),
	}
}

// add records a settlement of topic and reports whether it will be written: false once the
// settler is sealed.
func (st *settler) add(topic string, f func(*pending)) bool {
	st.mu.Lock()
	if st.sealed {
		st.mu.Unlock()
		return false
	}
	p, ok := st.topics[topic]
	if !ok {
		p = newPending()
		st.topics[topic] = p
	}
	f(p)
	st.mu.Unlock()
	select {
	case st.kick <- struct{}{}:
	default:
	}
	return true
}

func (st *settler) ack(topic string, r leaseRef) bool {
	return st.add(topic, func(p *pending) { p.ack(r) })
}

func (st *settler) update(topic string, u leaseUpdate) bool {
	return st.add(topic, func(p *pending) { p.update(u) })
}

// take removes and returns everything pending.
func (st *settler) take() map[string]*pending {
	st.mu.Lock()
	defer st.mu.Unlock()
	out := st.topics
	st.topics = map[string]*pending{}
	return out
}

// putBack returns settlements that could not be written, under those that came since.
func (st *settler) putBack(left map[string]*pending) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for topic, p := range left {
		if newer, ok := st.topics[topic]; ok {
			p.merge(newer)
		}
		st.topics[topic] = p
	}
}

func (st *settler) count() int {
	st.mu.Lock()
	defer st.mu.Unlock()
	n := 0
	for _, p := range st.topics {
		n += p.len()
	}
	return n
}

// run writes settlements until seal, then writes what is left, trying again until ctx ends.
func (st *settler) run(ctx context.Context) {
	defer close(st.done)
	cfg := st.q.cfg
	linger := time.NewTimer(0)
	<-linger.C
	failures := 0 // writes failed in a row: logged once, at the first
	for {
		select {
		case <-st.kick:
		case <-st.stop:
			st.final(ctx)
			return
		}
		if st.count() < maxSettleBatch {
			linger.Reset(settleLinger)
			select {
			case <-linger.C:
			case <-st.stop:
				linger.Stop()
			}
		}
		err := st.write(ctx)
		if err == nil && failures > 0 {
			st.log.Info("writing acknowledgements again", watermill.LogFields{"failures": failures})
			failures = 0
		}
		if err != nil {
			wait := cfg.RetryInterval
			if sqldb.Classify(err) == sqldb.Conflict {
				wait = cfg.PollInterval
			}
			if failures++; failures == 1 {
				st.log.Error("writing acknowledgements failed; trying again until it succeeds", err, watermill.LogFields{"wait_time": wait})
			} else {
				st.log.Debug("writing acknowledgements failed again", watermill.LogFields{"err": err.Error(), "failures": failures})
			}
			inflight.Pause(st.stop, wait)
			select {
			case st.kick <- struct{}{}:
			default:
			}
		}
	}
}

// write writes everything pending, and puts back what it could not write.
func (st *settler) write(ctx context.Context) error {
	var first error
	left := map[string]*pending{}
	for topic, p := range st.take() {
		for _, b := range p.batches() {
			if first == nil {
				err := st.q.d.settle(ctx, st.q.db, topic, st.q.cfg.ConsumerGroup, b)
				if err == nil {
					continue
				}
				first = fmt.Errorf("topic %q: %w", topic, err)
			}
			lp, ok := left[topic]
			if !ok {
				lp = newPending()
				left[topic] = lp
			}
			for _, r := range b.acks {
				lp.ack(r)
			}
			for _, u := range b.updates {
				lp.update(u)
			}
		}
	}
	if len(left) > 0 {
		st.putBack(left)
	}
	return first
}

// final seals the settler and writes what is pending, trying again until ctx ends.
func (st *settler) final(ctx context.Context) {
	st.mu.Lock()
	st.sealed = true
	st.mu.Unlock()
	for {
		err := st.write(ctx)
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			acks, updates := 0, 0
			for _, p := range st.take() {
				acks += len(p.acks)
				updates += len(p.updates)
			}
			st.err = fmt.Errorf("acknowledgements: %d, lease changes: %d not written (their messages are delivered again when the leases expire): %w", acks, updates, err)
			return
		}
		st.log.Error("writing acknowledgements at close failed; trying again", err, nil)
		inflight.Pause(ctx.Done(), st.q.cfg.PollInterval)
	}
}

// seal makes the settler write what is pending and stop; it returns when that is done, with
// what could not be written.
func (st *settler) seal() error {
	close(st.stop)
	<-st.done
	return st.err
}
