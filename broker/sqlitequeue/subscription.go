package sqlitequeue

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/sqldb"
)

// settleWait bounds how long an acknowledgement or nack waits to be committed with the ones
// that follow it, of its subscription and of the topic's others. It is not waited for when
// the subscription has nothing else in flight. Acknowledged messages leave the window at
// once: the wait holds up no claim.
const settleWait = 10 * time.Millisecond

// fillWait bounds how long room in a subscription's window waits to grow to half the window
// before messages are claimed anyway. A variable for the tests only.
var fillWait = 20 * time.Millisecond

// closeWait bounds the last transaction of a closing subscription (settling what was
// acknowledged and nacked, giving back the rest). When the file stays locked for longer, the
// leases expire by themselves.
const closeWait = 5 * time.Second

// subscription is one consumer of a topic in the queue's consumer group: a loop (run) that
// claims messages into its window and settles their leases in short transactions, and a
// hand-out goroutine that passes the claimed messages to the consumer. A consumer that settles
// directly (redelivery.SettlesDirectly, as onceflow's router does) reports each ack or nack
// itself, by redelivery.Settle; for any other, one goroutine per message handed out waits for
// its ack or nack.
type subscription struct {
	q      *Queue
	topic  string
	leases *leases
	window int
	resend time.Duration
	logger watermill.LoggerAdapter
	// direct says the consumer calls redelivery.Settle after every ack and nack.
	direct bool

	// ctx ends with the subscription: when the context given to Subscribe ends or the
	// Subscriber closes. The messages' contexts derive from it.
	ctx    context.Context
	cancel context.CancelFunc
	out    chan *message.Message

	events      chan event          // from the hand-out goroutine and the deliveries' watchers
	batches     chan []*delivery    // to the hand-out goroutine
	handed      chan struct{}       // from the hand-out goroutine: a batch is handed out
	hurried     chan struct{}       // from the consumer (redelivery.Flush): claim the room now
	flush       func()              // hurry, made once: a method value allocates each time
	handOutDone chan struct{}       // closed when the hand-out goroutine ends
	done        chan struct{}       // closed when run ends
	inflight    map[int64]*delivery // claimed and not settled, by offset; owned by run
	pending     *settlements        // given and not committed yet, shared with the topic's others
	// filled says that the last claim got all the room it asked for: more messages may
	// wait, and the next claim does not look first. Owned by run.
	filled bool
}

// event reports a delivery that ended: acknowledged, nacked, or unsettled (its lease passed,
// or it could not be handed out in time).
type event struct {
	d       *delivery
	outcome outcome
	at      time.Time
}

func newSubscription(ctx context.Context, q *Queue, topic string, l *leases) *subscription {
	cfg := q.cfg
	ctx, cancel := context.WithCancel(ctx)
	s := &subscription{
		q:           q,
		topic:       topic,
		leases:      l,
		window:      cfg.BatchSize,
		resend:      cfg.ResendInterval,
		direct:      redelivery.SettlesDirectly(ctx),
		logger:      cfg.log.With(watermill.LogFields{"topic": topic, "consumer_group": cfg.ConsumerGroup}),
		ctx:         ctx,
		cancel:      cancel,
		out:         make(chan *message.Message),
		events:      make(chan event, cfg.BatchSize),
		batches:     make(chan []*delivery, 1),
		handed:      make(chan struct{}, 1),
		hurried:     make(chan struct{}, 1),
		handOutDone: make(chan struct{}),
		done:        make(chan struct{}),
		inflight:    make(map[int64]*delivery, cfg.BatchSize),
		pending:     q.settlements(topic),
	}
	s.flush = s.hurry
	return s
}

// run claims and settles until the subscription ends, then settles what it can and gives back
// the rest, and closes the channel of messages.
func (s *subscription) run() {
	defer close(s.out)
	defer s.leases.close()
	defer close(s.done)
	go s.handOut()

	var (
		handing   bool      // a claimed batch is being handed out
		nextClaim time.Time // no claim before (after an empty claim or an error)
		retryAt   time.Time // no commit of the settlements before (after an error)
		// gave says that settlements of this subscription may wait: with nothing else in
		// flight, it commits them at once.
		gave bool
		// roomSince is when room came free in the window; zero after a claim.
		roomSince time.Time
		// hurry: the consumer settled a batch together and settles no more until new
		// messages come (redelivery.Flush): the room free is claimed at once.
		hurry bool
		// woken is closed when messages are published to the topic or Wake is called. It is
		// taken before a round, so that a wake-up during the round is not missed.
		woken <-chan struct{}
	)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for s.ctx.Err() == nil {
		if woken == nil {
			woken = s.q.store.woken(s.topic)
		}
		now := time.Now()
		room := s.window - len(s.inflight)
		canClaim := room > 0 && !handing
		flushBy, pending := s.pending.due()
		gave = gave && pending
		flush := pending && !now.Before(retryAt) && (!now.Before(flushBy) || gave && len(s.inflight) == 0)
		// A claim waits until half the window is free, so that each claims many messages and
		// commits the settlements given meanwhile in the same transaction (each transaction
		// of the queue file takes its write lock and writes its WAL), but no longer than
		// fillWait after room came free, so that a consumer that holds its messages until
		// more come gets them; with nothing in flight, or once the consumer settled a batch
		// together and waits for more (hurry), it goes at once.
		if !canClaim {
			roomSince = time.Time{}
		} else if roomSince.IsZero() {
			roomSince = now
		}
		fillAt := roomSince.Add(fillWait)
		claim := canClaim && !now.Before(nextClaim) && (len(s.inflight) == 0 || 2*room >= s.window || hurry || !now.Before(fillAt))
		if flush || claim {
			claimRoom := 0
			if claim {
				claimRoom = room
			}
			batch, err := s.round(claimRoom)
			gave = gave && err != nil
			if claim && err == nil {
				roomSince, hurry = time.Time{}, false
			}
			if err != nil {
				if s.ctx.Err() != nil {
					break
				}
				wait := s.backoff(err)
				nextClaim, retryAt = now.Add(wait), now.Add(wait)
				continue
			}
			if claimRoom > 0 && len(batch) < claimRoom {
				nextClaim = now.Add(s.q.cfg.PollInterval)
			}
			if len(batch) > 0 {
				handing = true
				s.batches <- batch
			}
			continue
		}

		var wake time.Time
		if pending {
			wake = flushBy
			if retryAt.After(wake) {
				wake = retryAt
			}
		}
		if canClaim {
			at := nextClaim
			if fillAt.After(at) && len(s.inflight) > 0 && 2*room < s.window {
				at = fillAt
			}
			if wake.IsZero() || at.Before(wake) {
				wake = at
			}
		}
		var timeout <-chan time.Time
		if !wake.IsZero() {
			timer.Reset(time.Until(wake))
			timeout = timer.C
		}
		var published <-chan struct{}
		if canClaim {
			published = woken
		}
		select {
		case e := <-s.events:
			gave = s.ended(e) || gave
			gave = s.endWaiting() || gave
		case <-s.handed:
			handing = false
		case <-s.hurried:
			// The batch's settlements came before: take those that wait, so that the
			// claim sees their room.
			hurry = true
			gave = s.endWaiting() || gave
		case <-published:
			nextClaim, woken = time.Time{}, nil
		case <-timeout:
		case <-s.ctx.Done():
		}
	}
	s.shutdown()
}

// round commits the pending settlements (the topic's other subscriptions' too) and claims up
// to room messages, in one transaction, and returns the claimed messages' deliveries. With
// nothing to settle, it first looks, without the write lock, whether there is anything to
// claim, unless its last claim filled all its room (a backlog is being drained).
func (s *subscription) round(room int) ([]*delivery, error) {
	if s.pending.len() == 0 && !s.filled {
		found, err := s.leases.anyToClaim(s.ctx, time.Now())
		if err != nil || !found {
			return nil, err
		}
	}
	var (
		rows    []claimedRow
		claimed time.Time
		settle  []settlement
		took    bool
	)
	err := s.q.writeLeases(s.ctx, func(tx *sql.Tx) error {
		// Taken in the file's turn, so that they are committed (or given back) before any
		// other transaction of the file looks for them.
		settle, took = s.pending.take(), true
		if err := s.leases.settle(s.ctx, tx, settle); err != nil {
			return err
		}
		if room == 0 {
			return nil
		}
		claimed = time.Now()
		var err error
		rows, err = s.leases.claim(s.ctx, tx, claimed, claimed.Add(s.q.cfg.AckDeadline), room)
		return err
	})
	if took {
		s.pending.done(settle, err != nil)
	}
	if err != nil {
		s.filled = false
		return nil, err
	}
	if room > 0 {
		s.filled = len(rows) == room
	}
	batch := make([]*delivery, 0, len(rows))
	for _, r := range rows {
		msg, err := newMessage(r.uuid, r.payload, r.metadata)
		if err != nil {
			s.logger.Error("Message with unreadable metadata; delivering it without", err, watermill.LogFields{"offset": r.offset, "msg_uuid": r.uuid})
		}
		var settled func(*delivery)
		if s.direct {
			settled = s.settled
		}
		d := newDelivery(s.ctx, msg, r, claimed.Add(s.q.cfg.AckDeadline), settled, s.flush)
		s.inflight[r.offset] = d
		batch = append(batch, d)
	}
	return batch, nil
}

// endWaiting takes note of every delivery whose end waits to be taken (ended), so that one
// transaction commits their settlements, and reports whether any gave a settlement to commit.
func (s *subscription) endWaiting() (gave bool) {
	for {
		select {
		case e := <-s.events:
			gave = s.ended(e) || gave
		default:
			return gave
		}
	}
}

// ended takes note of a delivery that ended while the subscription runs, and reports whether
// it gave a settlement to commit.
func (s *subscription) ended(e event) bool {
	if s.inflight[e.d.offset] != e.d {
		return false // not expected: each delivery ends once
	}
	if e.outcome == unsettled && e.d.handed.Load() && s.ctx.Err() != nil {
		// Its context ended with the subscription's, not with its lease: it stays in flight,
		// and shutdown gives it back at once. Taken for a lease that passed, it would wait
		// for its lease to pass before anyone got it again.
		return false
	}
	delete(s.inflight, e.d.offset)
	switch {
	case e.outcome != unsettled:
		s.pending.add(e.d.settlement(e.outcome, e.at, s.resend), time.Now())
	case !e.d.handed.Load():
		// Its lease passed before the consumer took it: give the claim back.
		s.pending.add(e.d.settlement(unsettled, e.at, s.resend), time.Now())
	default:
		// Its lease passed: it is due, for this subscription or another, with its count.
		s.logger.Info("Message not acknowledged within the ack deadline; it will be delivered again",
			watermill.LogFields{"msg_uuid": e.d.msg.UUID, "ack_deadline": s.q.cfg.AckDeadline})
		return false
	}
	return true
}

// handOut passes the claimed batches to the consumer, in order, and starts watching each
// message it hands out. A message whose lease passes before the consumer takes it is
// reported unsettled. It ends with the subscription.
func (s *subscription) handOut() {
	defer close(s.handOutDone)
	for {
		var batch []*delivery
		select {
		case batch = <-s.batches:
		case <-s.ctx.Done():
			return
		}
		for _, d := range batch {
			if d.ctx.Err() == nil {
				d.handed.Store(true)
				if s.give(d) {
					if s.direct {
						d.watchEnd(s.expired)
					} else {
						go s.watch(d)
					}
					continue
				}
				d.handed.Store(false)
			}
			if s.ctx.Err() != nil {
				return // run gives back what was not handed out
			}
			s.report(event{d: d, outcome: unsettled, at: time.Now()})
		}
		s.handed <- struct{}{}
	}
}

// give passes d's message to the consumer, and reports false when d's context ended first. A
// consumer that waits for it takes it without d's context being asked for its Done channel,
// which that would make.
func (s *subscription) give(d *delivery) bool {
	select {
	case s.out <- d.msg:
		return true
	default:
	}
	select {
	case s.out <- d.msg:
		return true
	case <-d.ctx.Done():
		return false
	}
}

// watch waits for the consumer's ack or nack of a delivery, or for the end of its context,
// and reports it. The message's context is cancelled then.
func (s *subscription) watch(d *delivery) {
	var o outcome
	select {
	case <-d.msg.Acked():
		o = acked
	case <-d.msg.Nacked():
		o = nacked
	case <-d.ctx.Done():
		o = d.outcomeNow()
	}
	at := time.Now()
	d.cancel()
	s.report(event{d: d, outcome: o, at: at})
}

// settled reports the ack or nack of a delivery whose consumer settles directly: it runs in
// the consumer's goroutine, from redelivery.Settle. The message's context is cancelled.
func (s *subscription) settled(d *delivery) {
	o := nacked
	if redelivery.Acked(d.msg) {
		o = acked
	}
	at := time.Now()
	d.cancel()
	s.report(event{d: d, outcome: o, at: at})
}

// expired reports a delivery, handed to a consumer that settles directly, whose context ended
// (its lease passed, or the subscription ended) before the consumer settled it.
func (s *subscription) expired(d *delivery) {
	s.report(event{d: d, outcome: d.outcomeNow(), at: time.Now()})
}

// hurry tells run that the consumer has settled a batch together and settles no more until
// new messages come (redelivery.Flush: a group that committed in one transaction): the room
// free then is claimed at once. A consumer that holds more than half the window in one group
// would otherwise wait fillWait for each refill, with its next group short.
func (s *subscription) hurry() {
	select {
	case s.hurried <- struct{}{}:
	default:
	}
}

// report sends e to run, unless run has ended.
func (s *subscription) report(e event) {
	select {
	case s.events <- e:
	case <-s.done:
	}
}

// shutdown ends a subscription: it cancels the contexts of the messages in flight, commits
// the acknowledgements and nacks given so far (those of the topic's other subscriptions that
// wait too) and gives back the other leases, in one transaction bounded by closeWait.
func (s *subscription) shutdown() {
	s.cancel()
	<-s.handOutDone
drain:
	for {
		select {
		case e := <-s.events:
			// An unsettled delivery stays in flight: it is given back below.
			if e.outcome != unsettled && s.inflight[e.d.offset] == e.d {
				delete(s.inflight, e.d.offset)
				s.pending.add(e.d.settlement(e.outcome, e.at, s.resend), e.at)
			}
		default:
			break drain
		}
	}
	now := time.Now()
	var own []settlement
	for _, d := range s.inflight {
		own = append(own, d.settlement(d.outcomeNow(), now, s.resend))
		d.cancel()
	}
	s.inflight = nil
	// The acknowledgements given to this subscription may be in another's transaction: once
	// it has ended, they are committed or wait again.
	s.pending.wait()
	if s.pending.len() == 0 && len(own) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeWait)
	defer cancel()
	var settle []settlement
	took := false
	err := s.q.writeLeases(ctx, func(tx *sql.Tx) error {
		settle, took = s.pending.take(), true
		return s.leases.settle(ctx, tx, append(settle, own...))
	})
	if took {
		s.pending.done(settle, err != nil)
	}
	if err != nil {
		s.logger.Error("Cannot settle the leases of a closing subscription; the unsettled ones are delivered again when they expire", err,
			watermill.LogFields{"leases": len(settle) + len(own)})
	}
}

// backoff logs err and returns how long the subscription waits before it tries again.
func (s *subscription) backoff(err error) time.Duration {
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		s.logger.Debug("Query ended by its context", watermill.LogFields{"err": err.Error()})
		return s.q.cfg.PollInterval
	case sqldb.Classify(err) == sqldb.Conflict:
		s.logger.Info("Queue database busy, trying again", watermill.LogFields{"err": err.Error()})
		return s.q.cfg.PollInterval
	}
	s.logger.Error("Cannot claim or settle messages of the queue", err, watermill.LogFields{"wait_time": s.q.cfg.RetryInterval})
	return s.q.cfg.RetryInterval
}
