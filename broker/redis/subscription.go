package redis

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker/redelivery"
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
// them.
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
	if room < s.readRoom() {
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
	return s.read(room, s.blockTime(now))
}

// fillWait bounds how long room in the window waits to grow to readRoom before new entries
// are read anyway.
const fillWait = 20 * time.Millisecond

// readRoom returns the room in the window from which a read of new or idle entries is sent at
// once: half the window.
func (s *subscription) readRoom() int { return max(1, (s.cfg.Prefetch+1)/2) }

// roomLeft returns how many more deliveries the window takes.
func (s *subscription) roomLeft() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return max(s.cfg.Prefetch-len(s.inflight), 0)
}

// waitForRoom waits until a delivery leaves the window, a parked entry needs its idle time
// pushed back or is due to be claimed back, until (unless zero), or the subscription stops.
func (s *subscription) waitForRoom(until time.Time) {
	s.mu.Lock()
	var next <-chan time.Time
	at := until
	for _, h := range []parkHeap{s.claims, s.refreshes} {
		if len(h) > 0 && (at.IsZero() || h[0].next.Before(at)) {
			at = h[0].next
		}
	}
	if !at.IsZero() {
		t := time.NewTimer(time.Until(at))
		defer t.Stop()
		next = t.C
	}
	s.mu.Unlock()
	select {
	case <-s.room:
	case <-s.wake:
	case <-next:
	case <-s.stopping:
	}
}

// blockTime returns how long the next XREADGROUP may wait: BlockTime, or less when a claim
// is due sooner.
func (s *subscription) blockTime(now time.Time) time.Duration {
	block := min(s.cfg.BlockTime, s.pass.due().Sub(now))
	s.mu.Lock()
	for _, h := range []parkHeap{s.claims, s.refreshes} {
		if len(h) > 0 {
			block = min(block, h[0].next.Sub(now))
		}
	}
	s.mu.Unlock()
	return max(block, time.Millisecond) // BLOCK 0 would wait for ever
}

// reader returns what the XREADGROUPs are sent on: a connection of their own, whose blocked
// read stop can end at once, or else the client.
func (s *subscription) reader() (redis.Cmdable, error) {
	if s.readConn != nil {
		return s.readConn, nil
	}
	c, ok := s.client.(interface {
		Conn() *redis.Conn
		Options() *redis.Options
	})
	if !ok {
		return s.client, nil
	}
	// A connection of its own is one of the pool's for good: leave the pool at least half.
	if s.owner.readConns.Add(1) > int32(c.Options().PoolSize/2) {
		s.owner.readConns.Add(-1)
		return s.client, nil
	}
	conn := c.Conn()
	id, err := conn.ClientID(s.opCtx).Result()
	if err != nil {
		_ = conn.Close()
		s.owner.readConns.Add(-1)
		return nil, fmt.Errorf("CLIENT ID: %w", err)
	}
	s.readConn = conn
	s.readID.Store(id)
	return conn, nil
}

// dropReader closes the connection of the reads; the next read opens another.
func (s *subscription) dropReader() {
	if s.readConn != nil {
		s.readID.Store(0)
		_ = s.readConn.Close()
		s.readConn = nil
		s.owner.readConns.Add(-1)
	}
}

// unblockReads ends the XREADGROUP that run waits for, until run is done or deadline
// passes. Without CLIENT UNBLOCK (another client, or an ACL that forbids it), run notices the
// stop within BlockTime.
func (s *subscription) unblockReads(deadline time.Time) {
	for time.Now().Before(deadline) {
		if id := s.readID.Load(); id != 0 {
			ctx, cancel := context.WithDeadline(s.opCtx, deadline)
			err := s.client.ClientUnblock(ctx, id).Err()
			cancel()
			if err != nil && !isConnErr(err) {
				return
			}
		}
		t := time.NewTimer(10 * time.Millisecond)
		select {
		case <-s.loopDone:
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// read delivers up to room new entries of the stream.
func (s *subscription) read(room int, block time.Duration) error {
	r, err := s.reader()
	if err != nil {
		return err
	}
	if s.isStopping() {
		return nil
	}
	sent := time.Now()
	streams, err := r.XReadGroup(s.opCtx, &redis.XReadGroupArgs{
		Group:    s.group,
		Consumer: s.consumer,
		Streams:  []string{s.topic, ">"},
		Count:    int64(room),
		Block:    block,
	}).Result()
	if errors.Is(err, redis.Nil) {
		return nil
	}
	if err != nil {
		s.dropReader()
		return fmt.Errorf("XREADGROUP: %w", err)
	}
	replied := time.Now()
	var batch []entry
	for _, st := range streams {
		for _, m := range st.Messages {
			batch = append(batch, entry{msg: m, count: 1}) // first delivery to the group
		}
	}
	s.deliver(batch, sent, replied)
	return nil
}

// entry is a stream entry that is ours to deliver, with its delivery count.
type entry struct {
	msg   redis.XMessage
	count int
}

// deliver registers the entries as deliveries and hands them to the pump. sent is when the
// command that made them ours was sent: no other consumer can claim them before sent plus
// AckTimeout, when their contexts are cancelled.
func (s *subscription) deliver(entries []entry, sent, replied time.Time) {
	batch := s.register(entries, sent, replied)
	if len(batch) == 0 {
		return
	}
	select {
	case s.handout <- batch:
	case <-s.stopping:
		// Registered: stop gives them back.
	}
}

func (s *subscription) register(entries []entry, sent, replied time.Time) []*delivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped || len(entries) == 0 {
		return nil
	}
	batch := make([]*delivery, 0, len(entries))
	for _, e := range entries {
		id := e.msg.ID
		if p := s.parked[id]; p != nil {
			s.unpark(p)
		}
		if _, ok := s.acking[id]; ok {
			// Claimed again while its XACK waits for a connection: the ack settles it.
			continue
		}
		if old := s.inflight[id]; old != nil {
			old.superseded = true // its ack deadline has passed; it is delivered anew
			if s.direct {
				s.leave(old, false, false)
				s.afterLeave(old, nil, false)
			} else {
				old.cancel()
			}
		}
		msg, _ := Marshaller{}.Unmarshal(e.msg.Values) // never fails
		d := &delivery{id: id, msg: msg, replied: replied}
		s.inflight[id] = d
		batch = append(batch, d)
		if s.direct {
			var ctx context.Context
			ctx, d.cancel = context.WithCancel(s.base)
			msg.SetContext(redelivery.NewSettleContext(newInfoContext(ctx, e.count), func() { s.settled(d) }))
			d.ctx = msg.Context()
			s.hold(d, sent.Add(s.cfg.AckTimeout))
			continue
		}
		ctx, cancel := context.WithDeadline(s.ctx, sent.Add(s.cfg.AckTimeout))
		ctx = newInfoContext(ctx, e.count)
		msg.SetContext(ctx)
		d.ctx, d.cancel, d.classified = ctx, cancel, make(chan struct{})
		s.watchers.Add(1)
		go s.watch(d)
	}
	return batch
}

// pump hands the registered deliveries out, in order, until the subscription stops. stop
// closes out once it is done, so that a consumer that sees the channel closed knows the acks
// it gave are in Redis.
func (s *subscription) pump() {
	defer close(s.pumpDone)
	for {
		select {
		case <-s.stopping:
			return
		case batch := <-s.handout:
			for _, d := range batch {
				if d.ctx.Err() != nil || s.isStopping() {
					continue // ended before the consumer took it: its goroutine settles it
				}
				select {
				case s.out <- d.msg:
				case <-s.stopping:
					return
				}
			}
		}
	}
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

// recoverFrom handles an error of the read loop, and reports whether the loop goes on.
func (s *subscription) recoverFrom(err error, failures int) bool {
	switch {
	case s.isStopping():
		return false
	case errors.Is(err, redis.ErrClosed):
		s.cfg.log.Error("Redis client closed under a subscription; ending it", err, s.fields)
		go s.stop()
		return false
	case redis.HasErrorPrefix(err, "NOGROUP"):
		// The stream or the group was deleted: its entries, and so the deliveries in flight,
		// are gone. Start again on a new one.
		s.cfg.log.Info("Redis stream or consumer group vanished; creating it again", s.fields.Add(watermill.LogFields{"err": err}))
		s.endInflight()
		if err := s.ensureGroup(s.opCtx); err != nil {
			s.cfg.log.Error("Could not create the consumer group again", err, s.fields)
			return s.sleep(backoff(failures))
		}
		s.pass.restart()
		return true
	case isConnErr(err):
		s.reconnect(err)
		return !s.isStopping()
	default:
		s.cfg.log.Error("Redis stream read failed", err, s.fields)
		return s.sleep(backoff(failures))
	}
}

// backoff returns the wait after the n-th failure in a row: 50 ms doubling up to 1 s.
func backoff(n int) time.Duration {
	d := 50 * time.Millisecond
	for i := 1; i < n && d < time.Second; i++ {
		d *= 2
	}
	return min(d, time.Second)
}

// isConnErr reports whether err says that Redis could not be reached or did not answer, as
// opposed to an answer that is an error.
func isConnErr(err error) bool {
	if err == nil || errors.Is(err, redis.Nil) || errors.Is(err, context.Canceled) {
		return false
	}
	var rerr redis.Error
	return !errors.As(err, &rerr)
}

// reconnect handles a lost connection: it ends the deliveries in flight (they may have lost
// their acks), waits until Redis answers again, then gives back every entry of the consumer
// that is not settled or parked, including those a read delivered into the consumer's
// pending list while the reply was lost, and claims at once.
func (s *subscription) reconnect(cause error) {
	s.cfg.log.Error("Lost the connection to Redis; deliveries in flight are cancelled and given back once it is back", cause, s.fields)
	s.endInflight()
	for n := 1; ; n++ {
		if s.isStopping() {
			return
		}
		ctx, cancel := context.WithTimeout(s.opCtx, time.Second)
		err := s.client.Ping(ctx).Err()
		cancel()
		if err == nil {
			break
		}
		if !s.sleep(backoff(n)) {
			return
		}
	}
	if err := s.ensureGroup(s.opCtx); err != nil {
		s.cfg.log.Error("Could not check the consumer group after reconnecting", err, s.fields)
		return
	}
	if _, err := s.giveBack(s.opCtx); err != nil {
		s.cfg.log.Error("Could not give back the deliveries in flight at the loss; they come back after AckTimeout", err, s.fields)
	}
	s.pass.restart()
	s.cfg.log.Info("Reconnected to Redis", s.fields)
}

// endInflight cancels the contexts of the deliveries in flight and waits until their
// goroutines have settled them (an ack or nack given before counts).
func (s *subscription) endInflight() {
	if s.direct {
		s.endHand()
		return
	}
	s.mu.Lock()
	ds := slices.Collect(maps.Values(s.inflight))
	s.mu.Unlock()
	for _, d := range ds {
		d.cancel()
	}
	for _, d := range ds {
		select {
		case <-d.classified:
		case <-s.stopping:
			return
		}
	}
}

// ensureGroup creates the consumer group, and the stream, unless they exist.
func (s *subscription) ensureGroup(ctx context.Context) error {
	err := s.client.XGroupCreateMkStream(ctx, s.topic, s.group, "0").Err()
	if err != nil && !redis.HasErrorPrefix(err, "BUSYGROUP") {
		return err
	}
	return nil
}
