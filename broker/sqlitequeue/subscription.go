package sqlitequeue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/internal/queuetable"
	"github.com/onceflow/onceflow/sqldb"
)

// settleWait bounds how long an acknowledgement or nack waits to be committed with the ones
// that follow it, of the topic's subscriptions (see commits). Acknowledged messages leave the
// window at once: the wait holds up no claim.
const settleWait = 10 * time.Millisecond

// fillWait is the subscriptions' inflight.Options.FillWait.
const fillWait = 20 * time.Millisecond

// closeWait bounds the end of a subscription: the end of its claim in progress, and its last
// transaction (settling what was acknowledged and nacked, giving back the rest). When the file
// stays locked for longer, the leases expire by themselves.
const closeWait = 5 * time.Second

// subscription is the inflight.Source of one Subscribe call: it claims (Fetch), turns each
// settlement into one of its lease (Settle, in delivery.go) and commits them with the topic's
// others (commit).
type subscription struct {
	q       *Queue
	topic   string
	leases  *leases
	logger  watermill.LoggerAdapter
	sub     *inflight.Subscription[lease]
	pending *settlements // given and not committed yet, shared with the topic's others

	// live counts the deliveries emitted and not settled; gave says that the subscription
	// gave settlements that wait; claiming, that Fetch is in a round. With nothing else in
	// flight and no round to take them, the subscription commits its settlements at once.
	live     atomic.Int64
	gave     atomic.Bool
	claiming atomic.Bool

	kick chan struct{} // Settle gave a settlement
	// opCtx ends the commits of the settlements; Close cancels it.
	opCtx       context.Context
	opCancel    context.CancelFunc
	commitsDone chan struct{}

	// filled says that the last claim got all the room it asked for: more messages may wait,
	// and the next claim does not look first. Fetch's own.
	filled bool
}

// errLeasePassed ends a delivery whose lease passed unsettled: the message may be claimed
// again, by any consumer of the group. It is a context.DeadlineExceeded.
var errLeasePassed = fmt.Errorf("sqlitequeue: the lease passed (Config.AckDeadline): %w", context.DeadlineExceeded)

// Fetch claims up to n messages and emits them (round). With nothing to claim it looks again
// after PollInterval or at a Wake, and after a failure after a backoff, until it has claimed
// something or ctx ends.
func (s *subscription) Fetch(ctx context.Context, n int) error {
	for {
		// Taken before the round, so that a publish during the round is not missed.
		woken := s.q.wakes.Woken(s.topic)
		s.claiming.Store(true)
		got, err := s.round(ctx, n)
		s.claiming.Store(false)
		inflight.Signal(s.kick)
		if ctx.Err() != nil {
			return nil
		}
		wait := s.q.cfg.PollInterval
		switch {
		case err != nil:
			wait = s.backoff(err)
		case got > 0:
			return nil
		}
		dbqueue.Wait(ctx, wait, woken)
	}
}

// round commits the pending settlements (the topic's other subscriptions' too) and claims up
// to room messages, in one transaction, and emits the claimed messages. With nothing to
// settle, it first looks, without the write lock, whether there is anything to claim, unless
// its last claim filled all its room (a backlog is being drained). It returns how many it
// claimed.
func (s *subscription) round(ctx context.Context, room int) (int, error) {
	if s.pending.len() == 0 && !s.filled {
		found, err := s.leases.anyToClaim(ctx, time.Now())
		if err != nil || !found {
			return 0, err
		}
	}
	var rows []claimedRow
	var until time.Time
	err := s.commit(ctx, func(tx *sql.Tx) error {
		now := time.Now()
		until = now.Add(s.q.cfg.AckDeadline)
		var err error
		rows, err = s.leases.claim(ctx, tx, now, until, room)
		return err
	})
	if err != nil {
		s.filled = false
		return 0, err
	}
	s.filled = len(rows) == room
	for _, r := range rows {
		msg, err := queuetable.NewMessage(r.uuid, r.payload, r.metadata)
		if err != nil {
			s.logger.Error("Message with unreadable metadata; delivering it without", err, watermill.LogFields{"offset": r.offset, "msg_uuid": r.uuid})
		}
		l := lease{offset: r.offset, deliveries: r.deliveries, claim: r.claim}
		s.live.Add(1)
		if s.sub.Emit(inflight.Item[lease]{Data: l, Msg: msg, Count: r.deliveries, Deadline: until}) == nil {
			// The subscription stops: give the claim back, for Close to commit.
			s.live.Add(-1)
			now := time.Now()
			s.pending.add(settlement{offset: l.offset, deliveries: l.deliveries, claim: l.claim, visibleAt: now, undeliver: true, from: s}, now)
		}
	}
	return len(rows), nil
}

// commit writes the settlements that wait, then runs claim (nil for nothing more), in one
// transaction of the queue file. The settlements it took wait again when it fails.
func (s *subscription) commit(ctx context.Context, claim func(tx *sql.Tx) error) error {
	var (
		settle []settlement
		took   bool
	)
	err := s.q.leases.run(ctx, rawDB(s.q.db), func(tx *sql.Tx) error {
		// Taken in the file's turn, so that they are committed (or given back) before any
		// other transaction of the file looks for them.
		s.gave.Store(false)
		settle, took = s.pending.take(), true
		if err := s.leases.settle(ctx, tx, settle); err != nil || claim == nil {
			return err
		}
		return claim(tx)
	})
	if took {
		s.pending.done(settle, err != nil)
	}
	return err
}

// commits commits the settlements that wait when no claim has taken them within settleWait
// of the oldest, or at once when this subscription gave some and has nothing else in flight
// nor a claim in progress (which takes them), until Close.
func (s *subscription) commits() {
	defer close(s.commitsDone)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var retryAt time.Time // no commit before (after an error)
	for {
		by, pending := s.pending.due()
		now := time.Now()
		if pending && !now.Before(retryAt) && (!now.Before(by) || s.gave.Load() && s.live.Load() == 0 && !s.claiming.Load()) {
			if err := s.commit(s.opCtx, nil); err != nil {
				if s.opCtx.Err() != nil {
					return
				}
				retryAt = now.Add(s.backoff(err))
			}
			continue
		}
		var timeout <-chan time.Time
		if pending {
			if retryAt.After(by) {
				by = retryAt
			}
			timer.Reset(time.Until(by))
			timeout = timer.C
		}
		select {
		case <-s.kick:
		case <-timeout:
		case <-s.opCtx.Done():
			return
		}
	}
}

// Close ends the commits of the subscription and commits, within ctx, the settlements that
// wait: those the engine gave at the end (the acknowledgements and nacks given before, the
// give-backs of the rest) and the topic's others. What it cannot commit is logged: those
// leases expire by themselves. It releases the prepared statements.
func (s *subscription) Close(ctx context.Context) error {
	defer s.leases.close()
	s.opCancel()
	<-s.commitsDone
	// The settlements given to this subscription may be in another's transaction: it waits
	// for that one, and commits those still waiting itself.
	for left := s.pending.wait(s); left > 0; left = s.pending.wait(s) {
		if err := s.commit(ctx, nil); err != nil {
			s.logger.Error("Cannot settle the leases of a closing subscription; the unsettled ones are delivered again when they expire", err,
				watermill.LogFields{"leases": left})
			return nil
		}
	}
	return nil
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
