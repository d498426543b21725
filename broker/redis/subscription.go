package redis

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
)

// subscription is one consumer of one stream: the goroutines of one Subscribe call.
//
//   - run reads new entries (XREADGROUP), claims idle ones (XAUTOCLAIM) and nacked ones whose
//     delay has passed (XCLAIM), registers the deliveries, and recovers from lost connections;
//   - pump hands the registered deliveries out on out, in the order they were read;
//   - flushAcks sends the acks given, coalesced into one XACK;
//   - each delivery has a goroutine (watch) that waits for its ack, nack or end, unless the
//     consumer settles each message itself (redelivery.WithDirectSettle, see hand.go).
//
// The window is inflight: registered deliveries that are not settled. A nacked delivery
// leaves it at once and becomes a parked entry.
type subscription struct {
	owner    *Subscriber
	client   redis.UniversalClient
	cfg      Config
	topic    string
	group    string
	consumer string
	fields   watermill.LogFields

	out     chan *message.Message
	handout chan []*delivery

	// ctx is the parent of the deliveries' contexts: Subscribe's context, cancelled when the
	// subscription stops.
	ctx    context.Context
	cancel context.CancelFunc
	// opCtx is the context of the Redis commands, cancelled when stop gives up or is done.
	opCtx    context.Context
	opCancel context.CancelFunc

	stopping  chan struct{} // closed when the subscription begins to stop
	flushStop chan struct{} // closed when the acks are to be drained
	loopDone  chan struct{}
	pumpDone  chan struct{}
	flushDone chan struct{}
	stopOnce  sync.Once
	stopErr   error

	watchers sync.WaitGroup // the deliveries' goroutines, and the parks of nacks settled directly

	// direct says that the consumer settles each message itself: the deliveries are in the
	// hand, not watched (see hand.go). base is then the parent of their contexts.
	direct bool
	base   context.Context

	mu        sync.Mutex
	stopped   bool                 // no delivery is registered any more
	inflight  map[string]*delivery // registered and unsettled, by entry id
	acks      []string             // acked, XACK not sent yet
	acking    map[string]struct{}  // acked, XACK not confirmed yet
	parked    map[string]*parked   // nacked, waiting for their delay
	claims    parkHeap             // parked entries to claim back when their delay ends
	refreshes parkHeap             // parked entries whose idle time must be pushed back
	hand      hand                 // the deliveries in flight, when direct

	room     chan struct{} // a delivery left the window
	ackReady chan struct{} // an ack was given
	wake     chan struct{} // a parked entry was queued
	// hurried: the consumer settled a batch together and settles no more until new entries
	// come (redelivery.Flush), so the next read goes at once, without waiting for readRoom.
	hurried atomic.Bool
	// flush is hurry, the function each delivery's redelivery.Flush runs: made once, as a
	// method value allocates each time it is taken.
	flush func()

	// readID is the Redis client id of readConn, 0 when there is none: stop unblocks its
	// XREADGROUP with CLIENT UNBLOCK.
	readID atomic.Int64

	// pass is the claim pass of the stream, shared with the Subscriber's other subscriptions
	// to it.
	pass *claimPass

	// State of run alone.
	nextReap time.Time
	// roomSince is when room came free in the window, below readRoom; zero after a read.
	roomSince time.Time
	// readConn is the connection of the XREADGROUPs, when the client can give one of its own
	// (a *redis.Client can, a cluster client cannot).
	readConn *redis.Conn
}

// delivery is one delivery of a stream entry.
type delivery struct {
	id     string
	msg    *message.Message
	ctx    context.Context
	cancel context.CancelFunc
	// replied is when the read or claim that delivered the entry returned: the entry's idle
	// time at the server is at least the time since then (while it is ours).
	replied time.Time
	// classified is closed when the delivery has left the window: acked, nacked or ended; nil
	// for a delivery in the hand, which leaves the window in the goroutine that ends it.
	classified chan struct{}
	// superseded says, under mu, that the entry was claimed again by the subscription while
	// this delivery was ending: its ack or nack must not touch the new delivery's entry.
	superseded bool
	// Under mu: the delivery has left the window (left); and, for a delivery in the hand, its
	// place there (prev, next) and when it ends unsettled (deadline).
	left       bool
	prev, next *delivery
	deadline   time.Time
}

func newSubscription(owner *Subscriber, ctx context.Context, topic, consumer string, direct bool) *subscription {
	s := &subscription{
		owner:     owner,
		client:    owner.client,
		cfg:       owner.cfg,
		topic:     topic,
		group:     owner.cfg.ConsumerGroup,
		consumer:  consumer,
		out:       make(chan *message.Message),
		handout:   make(chan []*delivery),
		stopping:  make(chan struct{}),
		flushStop: make(chan struct{}),
		loopDone:  make(chan struct{}),
		pumpDone:  make(chan struct{}),
		flushDone: make(chan struct{}),
		inflight:  map[string]*delivery{},
		acking:    map[string]struct{}{},
		parked:    map[string]*parked{},
		room:      make(chan struct{}, 1),
		ackReady:  make(chan struct{}, 1),
		wake:      make(chan struct{}, 1),
		pass:      owner.claimPass(topic),
		fields: watermill.LogFields{
			"provider": "redis", "topic": topic, "consumer_group": owner.cfg.ConsumerGroup, "consumer": consumer,
		},
	}
	s.ctx, s.cancel = context.WithCancel(ctx)
	s.opCtx, s.opCancel = context.WithCancel(context.Background())
	if direct {
		s.direct = true
		// The hand ends its deliveries' contexts itself; they need not register with the
		// subscription's context one by one.
		s.base = context.WithoutCancel(s.ctx)
		s.hand.timer = time.AfterFunc(time.Hour, s.expire)
		s.hand.timer.Stop()
	}
	s.flush = s.hurry
	return s
}

func (s *subscription) start() {
	s.owner.cfg.log.Info("Subscribing to Redis stream", s.fields)
	go s.run()
	go s.pump()
	go s.flushAcks()
	go func() {
		select {
		case <-s.ctx.Done():
			_ = s.stop()
		case <-s.stopping:
		}
	}()
}

func (s *subscription) isStopping() bool {
	select {
	case <-s.stopping:
		return true
	default:
		return false
	}
}

// signal wakes the goroutine that waits on c, if any; signals do not pile up.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// sleep waits d, and reports false if the subscription began to stop meanwhile.
func (s *subscription) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.stopping:
		return false
	}
}

// run is the read loop.
func (s *subscription) run() {
	defer close(s.loopDone)
	defer s.dropReader()
	s.nextReap = time.Now()
	failures := 0
	for !s.isStopping() {
		err := s.step()
		if err == nil {
			failures = 0
			continue
		}
		failures++
		if !s.recoverFrom(err, failures) {
			return
		}
	}
}

// step does the most urgent thing: push back the idle time of parked entries, claim back
// those whose delay has ended, claim entries left idle, or read new ones. New and idle entries
// are read when half the window is free (readRoom), or fillWait after room first came free,
// so that each read brings many (a read per delivery that left the window would cost a
// command per message), and a consumer that holds its deliveries until more come still gets
// them; or at once after the consumer settled a batch together (hurry).
func (s *subscription) step() error {
	now := time.Now()
	if !now.Before(s.nextReap) {
		s.nextReap = now.Add(reapInterval)
		s.reap()
	}
	if err := s.refreshParked(now); err != nil {
		return err
	}
	room := s.roomLeft()
	if room == 0 {
		s.waitForRoom(time.Time{})
		return nil
	}
	if due := s.popDue(&s.claims, now, room); len(due) > 0 {
		return s.claimParked(due)
	}
	if room < s.readRoom() && !s.hurried.Load() {
		if s.roomSince.IsZero() {
			s.roomSince = now
		}
		if fillAt := s.roomSince.Add(fillWait); now.Before(fillAt) {
			s.waitForRoom(fillAt)
			return nil
		}
	}
	s.roomSince = time.Time{}
	if cursor, ok := s.pass.begin(now); ok {
		return s.claimIdle(room, cursor)
	}
	s.hurried.Store(false)
	return s.read(room, s.blockTime(now))
}

// watch waits for the delivery's ack, nack or end, and settles it.
func (s *subscription) watch(d *delivery) {
	defer s.watchers.Done()
	var acked, nacked bool
	select {
	case <-d.msg.Acked():
		acked = true
	case <-d.msg.Nacked():
		nacked = true
	case <-d.ctx.Done():
		// An ack or nack given before the end counts, whichever select saw first.
		select {
		case <-d.msg.Acked():
			acked = true
		case <-d.msg.Nacked():
			nacked = true
		default:
		}
	}
	s.mu.Lock()
	p, acked := s.leave(d, acked, nacked)
	s.mu.Unlock()
	s.afterLeave(d, p, acked)
	if p != nil {
		s.park(p)
	}
}

// leave takes d out of the window, acked (its XACK queued), nacked (parked, returned) or
// neither (it stays pending as it is), and reports whether it was acked: an ack or nack of a
// delivery superseded by a newer one of its entry counts for nothing. The caller holds mu,
// and then calls afterLeave.
func (s *subscription) leave(d *delivery, acked, nacked bool) (*parked, bool) {
	if s.inflight[d.id] == d {
		delete(s.inflight, d.id)
	}
	d.left = true
	if s.direct {
		s.unhold(d)
	}
	if d.superseded {
		acked, nacked = false, false
	}
	var p *parked
	switch {
	case acked:
		s.acks = append(s.acks, d.id)
		s.acking[d.id] = struct{}{}
	case nacked:
		p = &parked{id: d.id, due: time.Now().Add(s.nackDelay(d)), touchedAt: d.replied, index: -1}
		if old := s.parked[d.id]; old != nil {
			s.unpark(old)
		}
		s.parked[d.id] = p
	}
	return p, acked
}

// hurry tells the subscription that the consumer has settled a batch together and settles no
// more until new entries come (redelivery.Flush: a group that committed in one transaction):
// the room free then is read at once. A consumer that holds more than half the window in one
// group would otherwise wait fillWait for each refill, with its next group short.
func (s *subscription) hurry() {
	s.hurried.Store(true)
	signal(s.room)
}

// afterLeave ends the context of d, which has left the window, and wakes the read loop, and
// the flush of the acks when it was acked. The nacked entry p, if any, is the caller's to
// park.
func (s *subscription) afterLeave(d *delivery, p *parked, acked bool) {
	if d.classified != nil {
		close(d.classified)
	}
	d.cancel()
	signal(s.room)
	if acked {
		signal(s.ackReady)
	}
}

// stop ends the subscription (see Subscriber.Close) and reports the acks it could not send.
func (s *subscription) stop() error {
	s.stopOnce.Do(func() {
		deadline := time.Now().Add(s.cfg.CloseTimeout)
		giveUp := time.AfterFunc(s.cfg.CloseTimeout, s.opCancel)
		defer giveUp.Stop()

		close(s.stopping)
		go s.unblockReads(deadline)
		s.mu.Lock()
		s.stopped = true
		s.mu.Unlock()
		s.cancel() // ends every delivery's context: the watchers settle them
		if s.direct {
			s.endHand() // or the hand does, now
		}
		<-s.pumpDone
		waitUntil(waitGroupDone(&s.watchers), deadline)
		waitUntil(s.loopDone, deadline)
		close(s.flushStop)
		waitUntil(s.flushDone, deadline)

		var errs []error
		s.mu.Lock()
		unsent := len(s.acks)
		s.mu.Unlock()
		if unsent > 0 {
			errs = append(errs, fmt.Errorf("redis: %d acks of stream %q (consumer group %q) were not sent before the close timeout (%s); those entries will be delivered again",
				unsent, s.topic, s.group, s.cfg.CloseTimeout))
		}
		left, err := s.giveBack(s.opCtx)
		switch {
		case err != nil:
			s.cfg.log.Error("Could not give back unsettled deliveries on close; they come back after AckTimeout", err, s.fields)
		case left == 0:
			s.removeConsumer(s.opCtx)
		}
		s.opCancel()
		s.owner.forget(s)
		close(s.out)
		s.stopErr = errors.Join(errs...)
		s.cfg.log.Info("Redis stream subscription ended", s.fields)
	})
	return s.stopErr
}

// waitGroupDone returns a channel closed when wg's count reaches zero.
func waitGroupDone(wg *sync.WaitGroup) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

// waitUntil waits for done until deadline.
func waitUntil(done <-chan struct{}, deadline time.Time) {
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}
