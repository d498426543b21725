package sqlqueue

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/sqldb"
)

// Subscriber is a consumer of the Queue's consumer group, a watermill message.Subscriber.
// Each Subscribe call is one competing consumer of the topic; see the package documentation
// for what it guarantees. A Subscriber is safe for concurrent use.
type Subscriber struct {
	q       *Queue
	log     watermill.LoggerAdapter
	settler *settler

	// closing is closed when Close begins.
	closing chan struct{}
	// writeCtx bounds the writing of settlements; Close cancels it when its time is up.
	writeCtx    context.Context
	writeCancel context.CancelFunc

	mu     sync.Mutex
	closed bool
	subs   map[*subscription]struct{}
	loops  sync.WaitGroup

	closeOnce sync.Once
	closeErr  error
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// AcksInTransaction reports true: every message carries a redelivery.TxAck that deletes its
// lease in the caller's transaction, for a handler whose database is the queue's
// (Handler.Dedup.AckInTransaction).
func (s *Subscriber) AcksInTransaction() bool { return true }

// Subscriber returns a new consumer of the Queue's consumer group. Close it when done.
func (q *Queue) Subscriber() *Subscriber {
	ctx, cancel := context.WithCancel(context.Background())
	s := &Subscriber{
		q:           q,
		log:         q.cfg.log.With(watermill.LogFields{"consumer_group": q.cfg.ConsumerGroup}),
		settler:     newSettler(q),
		closing:     make(chan struct{}),
		writeCtx:    ctx,
		writeCancel: cancel,
		subs:        map[*subscription]struct{}{},
	}
	go s.settler.run(ctx)
	return s
}

// SubscribeInitialize creates the tables of topic and the group's cursor row, as Subscribe
// does.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	return s.q.EnsureTopic(context.Background(), topic)
}

// Subscribe starts one competing consumer of topic in the Queue's consumer group, after
// creating the topic's tables if they are missing. The returned channel hands out up to
// Config.Prefetch unsettled deliveries at a time; it is closed when ctx ends or the Subscriber
// closes, after the deliveries still unsettled are given back.
//
// Each message's context derives from ctx and carries a redelivery.Info: Count is the
// message's delivery count, kept in its lease row (1 on a first delivery), and DelaysNacks is
// true. The context is cancelled when the lease passes (Config.AckTimeout after the claim)
// unsettled, when ctx ends, when the Subscriber closes, and after the message is settled.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if s.isClosed() {
		return nil, ErrClosed
	}
	if err := s.q.EnsureTopic(ctx, topic); err != nil {
		return nil, err
	}
	sub := &subscription{
		s:      s,
		topic:  topic,
		log:    s.log.With(watermill.LogFields{"topic": topic}),
		out:    make(chan *message.Message),
		direct: redelivery.SettlesDirectly(ctx),
		held:   map[*delivery]struct{}{},
		wake:   make(chan struct{}, 1),
	}
	sub.flush = sub.hurry
	sub.ctx, sub.cancel = context.WithCancel(ctx)
	sub.claimCtx, sub.stopClaims = context.WithCancel(sub.ctx)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		sub.cancel()
		return nil, ErrClosed
	}
	s.subs[sub] = struct{}{}
	s.loops.Add(1)
	s.mu.Unlock()
	go sub.run()
	return sub.out, nil
}

func (s *Subscriber) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// Close stops the Subscriber's subscriptions from claiming, gives back the leases of the
// deliveries that are unsettled (visible again at once, to any consumer of the group), writes
// every acknowledgement and nack given before, cancels the deliveries' contexts, and closes the
// subscriptions' channels. It returns within Config.CloseTimeout even when the database does
// not answer; then it reports the acknowledgements it could not write, whose messages are
// delivered again when their leases expire. Acknowledgements given after Close are not
// written. Close is idempotent; concurrent calls all return when the first is done, with its
// result.
func (s *Subscriber) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		subs := make([]*subscription, 0, len(s.subs))
		for sub := range s.subs {
			subs = append(subs, sub)
		}
		s.mu.Unlock()
		close(s.closing)
		timeUp := time.AfterFunc(s.q.cfg.CloseTimeout, s.writeCancel)
		defer timeUp.Stop()

		for _, sub := range subs {
			sub.stopClaims()
		}
		stopped := make(chan struct{})
		go func() {
			s.loops.Wait()
			close(stopped)
		}()
		select {
		case <-stopped:
		case <-s.writeCtx.Done():
			s.log.Error("subscriptions did not stop in time", s.writeCtx.Err(), watermill.LogFields{"close_timeout": s.q.cfg.CloseTimeout})
		}
		for _, sub := range subs {
			sub.cancel()
		}
		if err := s.settler.seal(); err != nil {
			s.closeErr = fmt.Errorf("sqlqueue: close subscriber of consumer group %q: %w", s.q.cfg.ConsumerGroup, err)
		}
		s.writeCancel()
	})
	return s.closeErr
}

func (s *Subscriber) forget(sub *subscription) {
	s.mu.Lock()
	delete(s.subs, sub)
	s.mu.Unlock()
}

// subscription is one Subscribe call: a loop that claims messages while its window has room
// and hands them out.
type subscription struct {
	s     *Subscriber
	topic string
	log   watermill.LoggerAdapter
	out   chan *message.Message
	// direct: the consumer calls redelivery.Settle after each ack or nack.
	direct bool

	// ctx is the parent of the deliveries' contexts; Close cancels it once the unsettled
	// leases are given back.
	ctx    context.Context
	cancel context.CancelFunc
	// claimCtx ends the claims: when ctx ends or Close begins.
	claimCtx   context.Context
	stopClaims context.CancelFunc

	mu   sync.Mutex
	held map[*delivery]struct{} // live deliveries: the window
	wake chan struct{}          // a place in the window was freed
	// hurried: the consumer settled a batch together and settles no more until new messages
	// come (redelivery.Flush), so the next claim takes the room free at once. Under mu.
	hurried bool
	// flush is hurry, the function each delivery's redelivery.Flush runs: made once, as a
	// method value allocates each time it is taken.
	flush func()
}

// hurry tells the subscription that the consumer has settled a batch together and settles no
// more until new messages come (redelivery.Flush: a group that committed in one transaction):
// the room free then is claimed at once. A consumer that holds more than half the window in
// one group would otherwise wait PollInterval for each refill, with its next group short.
func (sub *subscription) hurry() {
	sub.mu.Lock()
	sub.hurried = true
	sub.mu.Unlock()
	select {
	case sub.wake <- struct{}{}:
	default:
	}
}

// leave takes d, which was in state was, out of the window. The mutex is held.
func (sub *subscription) leave(d *delivery, was deliveryState) {
	if was != live {
		return
	}
	delete(sub.held, d)
	select {
	case sub.wake <- struct{}{}:
	default:
	}
}

// room returns the free places of the window, and whether the consumer hurried the next
// claim (hurry), which it then forgets once there is room.
func (sub *subscription) room() (int, bool) {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	room, hurried := sub.s.q.cfg.Prefetch-len(sub.held), sub.hurried
	if room > 0 {
		sub.hurried = false
	}
	return room, hurried
}

// waitForRoom waits until at least want places of the window are free, or until maxWait has
// passed with at least one free, or the consumer hurried the claim with at least one free, and
// returns how many are free: 0 when the claims end.
func (sub *subscription) waitForRoom(want int, maxWait time.Duration) int {
	t := time.NewTimer(maxWait)
	defer t.Stop()
	waited := false
	for sub.claimCtx.Err() == nil {
		room, hurried := sub.room()
		if room >= want || ((waited || hurried) && room > 0) {
			return room
		}
		select {
		case <-sub.wake:
		case <-t.C:
			waited = true
		case <-sub.claimCtx.Done():
		}
	}
	return 0
}

// run claims and hands out messages until claimCtx ends, then gives back what is unsettled
// and closes the channel.
func (sub *subscription) run() {
	defer sub.s.loops.Done()
	defer sub.s.forget(sub)
	defer close(sub.out)
	defer sub.release()

	cfg := sub.s.q.cfg
	// A claim costs a commit whether it takes one message or many: while deliveries are in
	// flight, wait until half the window is free before claiming, or PollInterval, unless
	// the consumer settled a batch together and waits for more (hurry).
	refill := (cfg.Prefetch + 1) / 2
	var st claimState
	for {
		room := sub.waitForRoom(refill, cfg.PollInterval)
		if room == 0 {
			return
		}
		// Taken before the claim, so that a Wake during the claim is not missed.
		woken := sub.s.q.woken(sub.topic)
		n, err := sub.claim(room, &st)
		if sub.claimCtx.Err() != nil {
			return
		}
		wait := cfg.PollInterval
		switch {
		case err != nil && sqldb.Classify(err) == sqldb.Conflict:
			// Another consumer claimed the same rows: claim again at once; what it took is
			// not there any more.
			st.busy = false
			sub.log.Debug("claim conflicted with another consumer; claiming again", watermill.LogFields{"err": err.Error()})
			continue
		case err != nil:
			st.busy = false
			woken = nil // after a failure, wait out the interval
			wait = cfg.RetryInterval
			sub.log.Error("claiming messages failed", err, watermill.LogFields{"wait_time": wait})
		case n > 0:
			st.busy = true
			continue
		default:
			st.busy = false
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-woken:
		case <-sub.claimCtx.Done():
		}
		t.Stop()
	}
}

// claimState is what a subscription's claims remember between rounds.
type claimState struct {
	// busy: the last round claimed messages, so the next claims at once, without probing.
	busy bool
	// dueAt is when due leases were last looked for. A busy subscription looks for them once
	// per PollInterval, so that a backlog of new messages costs one claim per batch.
	dueAt time.Time
}

// claim claims up to room messages, due leases first, and hands them out. An idle
// subscription first probes whether there is anything to claim. It returns how many it
// claimed.
func (sub *subscription) claim(room int, st *claimState) (int, error) {
	q := sub.s.q
	ctx, group, lease := sub.claimCtx, q.cfg.ConsumerGroup, q.cfg.AckTimeout
	due, fresh := time.Since(st.dueAt) >= q.cfg.PollInterval, true
	if !st.busy {
		var err error
		if due, fresh, err = q.d.probe(ctx, q.db, sub.topic, group); err != nil {
			return 0, fmt.Errorf("probe topic %q: %w", sub.topic, err)
		}
	}
	claimed := 0
	if due {
		// The lease runs from before the claim by the local clock, from the claim's
		// statement by the database's: the delivery's context ends first.
		deadline := time.Now().Add(lease)
		st.dueAt = deadline.Add(-lease)
		rows, err := q.d.claimDue(ctx, q.db, sub.topic, group, room, lease)
		if err != nil {
			return 0, fmt.Errorf("claim due leases of topic %q: %w", sub.topic, err)
		}
		if len(rows) == room {
			st.dueAt = time.Time{} // there may be more
		}
		claimed += len(rows)
		sub.handOut(rows, deadline)
	}
	if fresh && claimed < room && ctx.Err() == nil {
		deadline := time.Now().Add(lease)
		rows, err := q.d.claimNew(ctx, q.db, sub.topic, group, room-claimed, lease)
		if err != nil {
			return claimed, fmt.Errorf("claim new messages of topic %q: %w", sub.topic, err)
		}
		claimed += len(rows)
		sub.handOut(rows, deadline)
	}
	return claimed, nil
}

// handOut hands the claimed rows to the consumer, in order. A row whose message is gone
// (removed while leased) has its lease deleted.
func (sub *subscription) handOut(rows []row, deadline time.Time) {
	var l *claimLease
	if sub.direct {
		l = sub.newClaimLease(deadline)
	}
	ds := make([]*delivery, 0, len(rows))
	for _, r := range rows {
		if r.orphan {
			sub.s.settler.ack(sub.topic, leaseRef{offset: r.offset, deliveries: r.deliveries})
			continue
		}
		ds = append(ds, sub.newDelivery(r, deadline, l))
	}
	if l != nil {
		l.watch(sub)
	}
	for _, d := range ds {
		select {
		case sub.out <- d.msg:
			sub.mu.Lock()
			d.handedOut = true
			if l != nil && l.passed() {
				// The lease passed while the consumer took it: its callback may have run
				// before the hand-out.
				d.expireLocked()
			}
			sub.mu.Unlock()
			if !sub.direct {
				go d.watch()
			}
		case <-d.ctx.Done():
			// The lease passed before the consumer took the message, or the subscription
			// ends: release gives it back.
			if sub.claimCtx.Err() != nil {
				return
			}
			sub.mu.Lock()
			if d.state == live {
				d.giveBackLocked()
			}
			sub.mu.Unlock()
			d.cancel()
		case <-sub.claimCtx.Done():
			return
		}
	}
}

// release settles or gives back every delivery still in the window: one the consumer settled
// a moment ago is written as settled; the others are given back.
func (sub *subscription) release() {
	sub.mu.Lock()
	ds := make([]*delivery, 0, len(sub.held))
	for d := range sub.held {
		ds = append(ds, d)
	}
	sub.mu.Unlock()
	for _, d := range ds {
		select {
		case <-d.msg.Acked():
			d.settle(true)
			continue
		case <-d.msg.Nacked():
			d.settle(false)
			continue
		default:
		}
		sub.mu.Lock()
		if d.state == live {
			d.giveBackLocked()
		}
		handedOut := d.handedOut
		sub.mu.Unlock()
		if !handedOut {
			d.cancel()
		}
	}
}
