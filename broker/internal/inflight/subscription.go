package inflight

import (
	"container/heap"
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// Source is the broker side of one subscription; see the package documentation for who
// calls what, from which goroutine.
type Source[T any] interface {
	// Fetch takes up to n messages from the broker and gives each to Emit as it comes; an
	// error it returns ends the subscription.
	Fetch(ctx context.Context, n int) error
	// Settle tells the broker how a delivery ended (Outcome), once per delivery, and once
	// more for a late ack (Options.LateAcks) or as a held nack's hold begins (Outcome.Held).
	// It must not wait for the broker.
	Settle(d *Delivery[T], o Outcome)
	// Close sends what Settle left to send, gives back what the subscription holds, and
	// releases the source, within ctx. Its error is the subscription's.
	Close(ctx context.Context) error
}

// Flusher is a Source that acts on several settlements together (coalesced acks): Flush runs,
// in the consumer's goroutine, on redelivery.Flush, after the engine has made the free room
// of the window ready to fetch at once.
type Flusher interface {
	Flush()
}

// Contexter is a Source that adds values of its own to each delivery's context (a
// redelivery.TxAck): Context runs in Emit, before the engine adds its own.
type Contexter[T any] interface {
	Context(ctx context.Context, d *Delivery[T]) context.Context
}

// Options configure a Subscription.
type Options struct {
	// Prefetch is the window: how many deliveries the subscription holds unsettled.
	Prefetch int
	// AckTimeout, when not zero, is how long a delivery emitted without a deadline may stay
	// unsettled after its hand-out.
	AckTimeout time.Duration
	// NackDelay is the delay of a nack for which the consumer asked none.
	NackDelay time.Duration
	// HoldNacks says that the broker cannot delay a nack: the engine holds a nacked delivery
	// for its delay, out of the window, and tells Settle when the hold begins (Outcome.Held)
	// and when it ends.
	HoldNacks bool
	// LateAcks says that the source wants an ack given after its delivery ended
	// (Outcome.Late): its broker may still take it (a lease nobody claimed since).
	LateAcks bool
	// FillWait bounds how long free room smaller than half the window waits to grow before
	// it is fetched anyway. Eager fetches any free room at once after a fetch that brought
	// less than it asked for (the broker has no more at once: a new message must not wait).
	FillWait time.Duration
	Eager    bool
	// CloseTimeout bounds the end of the subscription: waiting for Fetch to return, and
	// Source.Close.
	CloseTimeout time.Duration
	// ErrExpired is the cause of a delivery's context when its deadline passes.
	ErrExpired error
	// Log receives the subscription's logs.
	Log watermill.LoggerAdapter
}

// Subscription is the engine of one Subscribe call, as the package documentation says. New
// makes one; Start starts it.
type Subscription[T any] struct {
	src  Source[T]
	cx   Contexter[T] // src, when it is one
	opt  Options
	log  watermill.LoggerAdapter
	ctx  context.Context // the Subscribe context
	base context.Context // ctx without its cancellation: the parent of the deliveries' contexts
	// direct: the consumer calls redelivery.Settle after each ack or nack.
	direct bool
	// flush is the function of redelivery.Flush, made once.
	flush func()

	out chan *message.Message

	fetchCtx    context.Context
	fetchCancel context.CancelCauseFunc

	queuedSig chan struct{} // signalled (not counted) when a delivery is queued
	endedSig  chan struct{} // signalled when deliveries end before their hand-out
	room      chan struct{} // signalled when places come free, or on Hurry
	stopping  chan struct{} // closed when the subscription begins to stop
	runDone   chan struct{}
	pumpDone  chan struct{}
	stopOnce  sync.Once
	stopErr   error
	stopped   chan struct{} // closed when stop is done
	group     *Group
	unwatch   func() bool // ends the watch of ctx
	watchers  sync.WaitGroup
	holding   sync.WaitGroup // holds beginning: the source is told, the heap not yet

	mu sync.Mutex
	// The window: places taken by deliveries (queued or out), by the fetch in progress
	// (reserved, of which fetched were emitted), and by messages the source keeps to emit
	// later (kept).
	live, reserved, fetched, kept int
	hurried                       bool
	// endGen is closed and replaced when deliveries end before their settlement: their
	// watchers wake.
	endGen chan struct{}
	// The deliveries queued or out, by deadline (a zero deadline last).
	head, tail *Delivery[T]
	// The deliveries queued for their hand-out, in order, from qhead.
	queue []*Delivery[T]
	qhead int
	held  holds[T]
	timer *time.Timer
	armed time.Time // when timer fires; zero when it is stopped
	// ending: the subscription is stopping; Emit refuses, settlements wait for the sweep.
	ending bool
}

// New returns the engine of one subscription of src, whose consumer subscribed with ctx.
// The source keeps it to Emit, End and Hurry; Start starts it.
func New[T any](ctx context.Context, src Source[T], opt Options) *Subscription[T] {
	if opt.Log == nil {
		opt.Log = watermill.NopLogger{}
	}
	if opt.ErrExpired == nil {
		opt.ErrExpired = context.DeadlineExceeded
	}
	s := &Subscription[T]{
		src:       src,
		opt:       opt,
		log:       opt.Log,
		ctx:       ctx,
		base:      detach(ctx),
		direct:    redelivery.SettlesDirectly(ctx),
		out:       make(chan *message.Message),
		queuedSig: make(chan struct{}, 1),
		endedSig:  make(chan struct{}, 1),
		room:      make(chan struct{}, 1),
		stopping:  make(chan struct{}),
		runDone:   make(chan struct{}),
		pumpDone:  make(chan struct{}),
		stopped:   make(chan struct{}),
		endGen:    make(chan struct{}),
	}
	s.cx, _ = src.(Contexter[T])
	if f, ok := src.(Flusher); ok {
		s.flush = func() {
			s.Hurry()
			f.Flush()
		}
	} else {
		s.flush = s.Hurry
	}
	s.fetchCtx, s.fetchCancel = context.WithCancelCause(context.Background())
	s.timer = time.AfterFunc(time.Hour, s.tick)
	s.timer.Stop()
	return s
}

// detach returns ctx without its cancellation, as context.WithoutCancel does, under a value
// context of its own. Every value a delivery's context does not carry is looked up in it: a
// lookup that begins at the context of WithoutCancel boxes that context (an allocation per
// lookup), one that begins at a value context above it walks through it without.
func detach(ctx context.Context) context.Context {
	return context.WithValue(context.WithoutCancel(ctx), detachedKey{}, nil)
}

type detachedKey struct{}

// Start starts the subscription in g (nil for none) and returns its channel. It fails with
// the Group's ErrClosed when g is closed; the source is then the caller's to release.
func (s *Subscription[T]) Start(g *Group) (<-chan *message.Message, error) {
	if g != nil {
		if !g.subs.Add(s) {
			s.fetchCancel(g.errClosed)
			return nil, g.errClosed
		}
		s.group = g
	}
	s.unwatch = context.AfterFunc(s.ctx, func() { go s.stop(context.Cause(s.ctx)) })
	go s.run()
	go s.pump()
	return s.out, nil
}

// Stopping returns a channel that is closed when the subscription begins to stop.
func (s *Subscription[T]) Stopping() <-chan struct{} { return s.stopping }

// run fetches while the window has room, until the subscription stops.
func (s *Subscription[T]) run() {
	defer close(s.runDone)
	eager := true
	for {
		n := s.reserve(eager)
		if n == 0 {
			return
		}
		err := s.src.Fetch(s.fetchCtx, n)
		s.mu.Lock()
		got := s.fetched
		s.reserved, s.fetched = 0, 0
		s.mu.Unlock()
		Signal(s.room)
		if err != nil && s.fetchCtx.Err() == nil {
			s.log.Error("Subscription ends: fetching failed", err, nil)
			go s.stop(err)
			return
		}
		eager = s.opt.Eager && got < n
	}
}

// reserve waits for free room in the window and reserves it all for a fetch: once half the
// window is free; or once some is and eager is set, the consumer hurried, or FillWait has
// passed. It returns 0 when the subscription stops.
func (s *Subscription[T]) reserve(eager bool) int {
	var waited <-chan time.Time
	filled := false
	for {
		s.mu.Lock()
		if s.ending {
			s.mu.Unlock()
			return 0
		}
		free := s.opt.Prefetch - s.live - s.reserved - s.kept
		if free > 0 && (2*free >= s.opt.Prefetch || eager || filled || s.hurried) {
			s.reserved += free
			s.hurried = false
			s.mu.Unlock()
			return free
		}
		s.mu.Unlock()
		if free > 0 && s.opt.FillWait <= 0 {
			filled = true
			continue
		}
		if free > 0 && waited == nil {
			t := time.NewTimer(s.opt.FillWait)
			defer t.Stop()
			waited = t.C
		}
		select {
		case <-s.room:
		case <-waited:
			filled = true
		case <-s.stopping:
			return 0
		}
	}
}

// Hurry makes the next fetch take the free room at once, without waiting for half the window:
// the consumer has settled a batch together (redelivery.Flush), or the source has something
// due (a nacked message whose delay ended).
func (s *Subscription[T]) Hurry() {
	s.mu.Lock()
	s.hurried = true
	s.mu.Unlock()
	Signal(s.room)
}

// Keep keeps k of the places reserved for the fetch in progress after it returns, for
// messages that the source emits later, in an order of its own, with Item.Kept; Release gives
// kept places back. It returns how many it kept: fewer than k when messages emitted during the
// fetch without Item.Kept (redeliveries) took reserved places. Only Fetch calls Keep.
func (s *Subscription[T]) Keep(k int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	k = min(k, s.reserved)
	s.reserved -= k
	s.kept += k
	return k
}

// Release gives back k places that Keep kept (their messages are gone: a revoked partition).
func (s *Subscription[T]) Release(k int) {
	s.mu.Lock()
	s.kept -= min(k, s.kept)
	s.mu.Unlock()
	Signal(s.room)
}

// Emit makes it a delivery, queued for its hand-out after those emitted before, and returns
// it. It takes a place kept (it.Kept), or else one reserved for the fetch in progress if one is
// left, and a new place otherwise (the window may then hold more than Prefetch for a moment).
// It returns nil once the subscription is stopping: the message is then the source's to give
// back (or to leave to the broker's own deadline). Emit never blocks, and may be called from
// any goroutine.
func (s *Subscription[T]) Emit(it Item[T]) *Delivery[T] {
	d := &Delivery[T]{Data: it.Data, Msg: it.Msg, sub: s, deadline: it.Deadline, index: -1}
	d.ctx.base, d.ctx.d = s.base, d
	var settler redelivery.Settler
	if s.direct {
		settler = &d.ctx
	}
	d.ctx.vals.Init(redelivery.Info{Count: it.Count, Redelivered: it.Redelivered, DelaysNacks: true}, settler)
	var ctx context.Context = &d.ctx
	if s.cx != nil {
		ctx = s.cx.Context(ctx, d)
	}
	d.Msg.SetContext(ctx)

	s.mu.Lock()
	if s.ending {
		s.mu.Unlock()
		d.ctx.end(context.Canceled)
		return nil
	}
	switch {
	case it.Kept && s.kept > 0:
		s.kept--
	case !it.Kept && s.reserved > 0:
		s.reserved--
		s.fetched++
	}
	s.live++
	s.insert(d)
	if s.qhead > 0 && 2*s.qhead >= len(s.queue) {
		// The pump has taken the first half: move the rest to the front, so that a queue
		// that never empties does not grow.
		n := copy(s.queue, s.queue[s.qhead:])
		clear(s.queue[n:])
		s.queue, s.qhead = s.queue[:n], 0
	}
	s.queue = append(s.queue, d)
	s.mu.Unlock()
	Signal(s.queuedSig)
	return d
}

// pump hands the queued deliveries out, in order, until the subscription stops.
func (s *Subscription[T]) pump() {
	defer close(s.pumpDone)
	for {
		s.mu.Lock()
		for s.qhead == len(s.queue) {
			s.queue, s.qhead = s.queue[:0], 0
			s.mu.Unlock()
			select {
			case <-s.queuedSig:
			case <-s.stopping:
				return
			}
			s.mu.Lock()
		}
		d := s.queue[s.qhead]
		s.queue[s.qhead] = nil
		s.qhead++
		st := d.state
		s.mu.Unlock()
		if st == queued && !s.handOut(d) {
			return
		}
	}
}

// handOut hands d to the consumer, unless it ends first, and reports false when the
// subscription stops first.
func (s *Subscription[T]) handOut(d *Delivery[T]) bool {
	for {
		select {
		case s.out <- d.Msg:
			s.mu.Lock()
			d.handed = true
			st, gen := d.state, s.endGen
			if st == queued {
				d.state = out
				d.takenAt = time.Now()
				if d.deadline.IsZero() && s.opt.AckTimeout > 0 {
					s.unlink(d)
					d.deadline = d.takenAt.Add(s.opt.AckTimeout)
					s.insert(d)
				}
			}
			s.mu.Unlock()
			if !s.direct && st == queued {
				s.watchers.Add(1)
				go s.watch(d, gen)
			}
			return true
		case <-s.endedSig:
			// Deliveries ended; is d one of them? (Waiting on d's context instead would cost
			// an allocation per delivery.)
			s.mu.Lock()
			st := d.state
			s.mu.Unlock()
			if st != queued {
				Signal(s.endedSig) // for the next one, if it ended too
				return true
			}
		case <-s.stopping:
			return false
		}
	}
}

// watch waits for the ack or nack of d, handed out to a consumer that does not settle
// directly, or for its end. gen is the subscription's endGen when d was handed out: it is
// closed when deliveries end (waiting on d's context instead would cost an allocation per
// delivery).
func (s *Subscription[T]) watch(d *Delivery[T], gen chan struct{}) {
	defer s.watchers.Done()
	for {
		select {
		case <-d.Msg.Acked():
			s.settle(d, true)
			return
		case <-d.Msg.Nacked():
			s.settle(d, false)
			return
		case <-gen:
			s.mu.Lock()
			st := d.state
			gen = s.endGen
			s.mu.Unlock()
			if st != out {
				return
			}
		case <-s.stopping:
			return
		}
	}
}

// settle takes the consumer's ack or nack of d: d leaves the window, and the source learns it,
// unless the nack is held. Once the subscription is stopping, it waits for the sweep, which
// reads the ack or nack from the message.
func (s *Subscription[T]) settle(d *Delivery[T], acked bool) {
	s.mu.Lock()
	switch st := d.state; {
	case s.ending:
		// The end reads the ack or nack from the message of each delivery it ends (tell): one
		// it has ended already must not be reported again as a late ack.
		s.mu.Unlock()
		return
	case st == ended || st == held:
		s.mu.Unlock()
		if acked && s.opt.LateAcks && st == ended {
			s.src.Settle(d, Outcome{Acked: true, Late: true, HandedOut: d.takenAt})
		}
		return
	}
	d.handed = true
	if d.takenAt.IsZero() { // settled before the pump could record its hand-out
		d.takenAt = time.Now()
	}
	s.unlink(d)
	s.live--
	o := Outcome{Acked: acked, Nacked: !acked, HandedOut: d.takenAt}
	if !acked {
		o.Delay = d.nackDelay()
		if s.opt.HoldNacks && o.Delay > 0 {
			// The source learns of the hold before the delivery can end again: the timer,
			// End and the end of the subscription find it in the heap only after.
			d.state = held
			d.due = time.Now().Add(o.Delay)
			s.holding.Add(1)
			s.mu.Unlock()
			d.ctx.end(nil)
			Signal(s.room)
			o.Held = true
			s.src.Settle(d, o)
			s.mu.Lock()
			heap.Push(&s.held, d)
			s.arm()
			s.mu.Unlock()
			s.holding.Done()
			return
		}
	}
	d.state = ended
	s.mu.Unlock()
	s.src.Settle(d, o)
	d.ctx.end(nil)
	Signal(s.room)
}

// End ends the deliveries in flight for which match reports true (every one when match is
// nil), as their broker dropped them (a lost connection, a revoked partition), held nacks
// included (not one whose hold is beginning, whose Settle with Outcome.Held is running: it
// ends with its hold, and its source, which knows that its broker dropped it, sends nothing):
// the source learns each with the ack or nack given before and cause, by Settle, in the
// goroutine that calls End, which must therefore not hold the locks that Settle takes. A
// queued one is not handed out. It returns how many it ended.
func (s *Subscription[T]) End(cause error, match func(*Delivery[T]) bool) int {
	return s.end(cause, match, false)
}

// Withdraw ends, as End does, the deliveries that match and that the consumer has not taken
// yet (emitted, queued for their hand-out): their source stops handing them out (a partition
// being revoked), and waits only for those the consumer has. It returns how many it ended.
func (s *Subscription[T]) Withdraw(cause error, match func(*Delivery[T]) bool) int {
	return s.end(cause, match, true)
}

// end ends the deliveries in flight that match, only the queued ones with queuedOnly, the held
// nacks otherwise.
func (s *Subscription[T]) end(cause error, match func(*Delivery[T]) bool, queuedOnly bool) int {
	if cause == nil {
		cause = context.Canceled
	}
	s.mu.Lock()
	var ends []*Delivery[T]
	for d := s.head; d != nil; {
		next := d.next
		if (!queuedOnly || d.state == queued) && (match == nil || match(d)) {
			s.unlink(d)
			s.live--
			d.state = ended
			ends = append(ends, d)
		}
		d = next
	}
	if !queuedOnly {
		for i := 0; i < len(s.held); {
			d := s.held[i]
			if match == nil || match(d) {
				heap.Remove(&s.held, i)
				d.state = ended
				ends = append(ends, d)
				continue
			}
			i++
		}
		s.arm()
	}
	s.mu.Unlock()
	s.tell(ends, cause)
	return len(ends)
}

// tell ends the contexts of the deliveries that ended with cause, tells the source how, and
// wakes the pump and the fetch loop.
func (s *Subscription[T]) tell(ends []*Delivery[T], cause error) {
	now := time.Now()
	for _, d := range ends {
		o := Outcome{HandedOut: d.takenAt}
		if !d.due.IsZero() { // a held nack
			o.Nacked, o.Delay, o.Cause = true, max(d.due.Sub(now), 0), cause
		} else {
			o.Acked, o.Nacked = d.given()
			if o.Nacked {
				o.Delay = d.nackDelay()
			}
			o.Cause = cause
		}
		d.ctx.end(cause)
		s.src.Settle(d, o)
	}
	if len(ends) > 0 {
		Signal(s.endedSig)
		Signal(s.room)
		if !s.direct {
			s.mu.Lock()
			close(s.endGen)
			s.endGen = make(chan struct{})
			s.mu.Unlock()
		}
	}
}

// tick ends the deliveries whose deadline has passed and sends the held nacks that are due,
// and sets the timer for the next of either.
func (s *Subscription[T]) tick() {
	now := time.Now()
	s.mu.Lock()
	s.armed = time.Time{}
	var expired, due []*Delivery[T]
	for d := s.head; d != nil && !d.deadline.IsZero() && !d.deadline.After(now); d = s.head {
		s.unlink(d)
		s.live--
		d.state = ended
		expired = append(expired, d)
	}
	for len(s.held) > 0 && !s.held[0].due.After(now) {
		d := heap.Pop(&s.held).(*Delivery[T])
		d.state = ended
		due = append(due, d)
	}
	s.arm()
	s.mu.Unlock()
	s.tell(expired, s.opt.ErrExpired)
	for _, d := range due {
		s.src.Settle(d, Outcome{Nacked: true, HandedOut: d.takenAt})
	}
}

// arm sets the timer for the first deadline or held nack. mu is held.
func (s *Subscription[T]) arm() {
	var at time.Time
	if s.head != nil && !s.head.deadline.IsZero() {
		at = s.head.deadline
	}
	if len(s.held) > 0 && (at.IsZero() || s.held[0].due.Before(at)) {
		at = s.held[0].due
	}
	switch {
	case at.IsZero():
		if !s.armed.IsZero() {
			s.timer.Stop()
			s.armed = time.Time{}
		}
	case s.armed.IsZero() || at.Before(s.armed):
		s.armed = at
		s.timer.Reset(time.Until(at))
	}
}

// insert links d into the list of deliveries in flight, by deadline. mu is held.
func (s *Subscription[T]) insert(d *Delivery[T]) {
	// Deliveries come mostly in the order of their deadlines: look from the end.
	at := s.tail
	for at != nil && after(at.deadline, d.deadline) {
		at = at.prev
	}
	d.prev = at
	if at == nil {
		d.next = s.head
		s.head = d
	} else {
		d.next = at.next
		at.next = d
	}
	if d.next == nil {
		s.tail = d
	} else {
		d.next.prev = d
	}
	if s.head == d && !d.deadline.IsZero() {
		s.arm()
	}
}

// unlink takes d out of the list of deliveries in flight. mu is held.
func (s *Subscription[T]) unlink(d *Delivery[T]) {
	if d.prev == nil {
		s.head = d.next
	} else {
		d.prev.next = d.next
	}
	if d.next == nil {
		s.tail = d.prev
	} else {
		d.next.prev = d.prev
	}
	d.prev, d.next = nil, nil
}

// stop ends the subscription with cause, once: it stops fetching and ends the deliveries'
// contexts; once Fetch has returned (or CloseTimeout has passed) it tells the source how each
// delivery in flight ended (the ack or nack given before counts) and each held nack, then
// closes the source and the channel. Every call returns when the first is done, with the
// source's error.
func (s *Subscription[T]) stop(cause error) error {
	s.stopOnce.Do(func() {
		if cause == nil {
			cause = context.Canceled
		}
		ctx, cancel := context.WithTimeout(context.Background(), s.opt.CloseTimeout)
		defer cancel()
		s.mu.Lock()
		s.ending = true
		var inflight []*Delivery[T]
		for d := s.head; d != nil; d = d.next {
			inflight = append(inflight, d)
		}
		s.mu.Unlock()
		close(s.stopping)
		s.fetchCancel(cause)
		if s.unwatch != nil {
			s.unwatch()
		}
		for _, d := range inflight {
			d.ctx.end(cause)
		}
		<-s.pumpDone
		Wait(ctx, s.runDone)
		s.holding.Wait()
		s.end(cause, nil, false) // every delivery and held nack; the timer stops with the last
		s.watchers.Wait()

		s.stopErr = s.src.Close(ctx)
		if s.group != nil {
			s.group.subs.Remove(s)
		}
		close(s.out)
		close(s.stopped)
	})
	<-s.stopped
	return s.stopErr
}

// Sleep waits d, and reports false when the subscription begins to stop first: for a source's
// pause after a failure.
func (s *Subscription[T]) Sleep(d time.Duration) bool { return Pause(s.stopping, d) }
