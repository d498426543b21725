package sqlqueue

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/sqldb"
)

// Subscriber is a consumer of the Queue's consumer group, a watermill message.Subscriber.
// Each Subscribe call is one competing consumer of the topic; see the package documentation
// for what it guarantees. A Subscriber is safe for concurrent use.
type Subscriber struct {
	q       *Queue
	log     watermill.LoggerAdapter
	settler *inflight.Writer[settlement]
	subs    *inflight.Group

	// writeCancel ends the writing of settlements: Close calls it when its time is up.
	writeCancel context.CancelFunc
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// AcksInTransaction reports true: every message carries a redelivery.TxAck that deletes its
// lease in the caller's transaction, for a handler whose database is the queue's
// (Handler.Dedup.Mode DedupAckInTransaction).
func (s *Subscriber) AcksInTransaction() bool { return true }

// Subscriber returns a new consumer of the Queue's consumer group. Close it when done.
func (q *Queue) Subscriber() *Subscriber {
	ctx, cancel := context.WithCancel(context.Background())
	return &Subscriber{
		q:           q,
		log:         q.cfg.log.With(watermill.LogFields{"consumer_group": q.cfg.ConsumerGroup}),
		settler:     newSettler(ctx, q),
		subs:        inflight.NewGroup(ErrClosed),
		writeCancel: cancel,
	}
}

// SubscribeInitialize creates the tables of topic and the group's cursor row, as Subscribe
// does.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	return s.q.EnsureTopic(context.Background(), topic)
}

// Subscribe starts one competing consumer of topic in the Queue's consumer group, as the
// package documentation says (Delivery), after creating the topic's tables if they are
// missing. A delivery's context is cancelled with context.DeadlineExceeded when its lease
// passes, with ErrClosed at Close.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.subs.Check(); err != nil {
		return nil, err
	}
	if err := s.q.EnsureTopic(ctx, topic); err != nil {
		return nil, err
	}
	cfg := s.q.cfg
	sub := &subscription{
		s:       s,
		q:       s.q,
		topic:   topic,
		log:     s.log.With(watermill.LogFields{"topic": topic}),
		ackStmt: s.q.d.ackInTx(topic),
	}
	sub.outage = inflight.Outage{Log: sub.log, What: "claiming messages"}
	sub.sub = inflight.New(ctx, sub, inflight.Options{
		Prefetch:  rules.Window(ctx, s.q.cfg.Prefetch),
		NackDelay: cfg.NackDelay,
		LateAcks:  true,
		// A claim costs a commit however many messages it takes.
		FillWait:     cfg.PollInterval,
		CloseTimeout: cfg.CloseTimeout,
		ErrExpired:   errLeasePassed,
		Log:          sub.log,
	})
	return sub.sub.Start(s.subs)
}

// Close ends the Subscriber's subscriptions: it gives back the leases of the unsettled
// deliveries (visible again at once) and writes every acknowledgement and nack given before,
// within Config.CloseTimeout even when the database does not answer; then it reports the
// acknowledgements it could not write, whose messages are delivered again when their leases
// expire. Close is idempotent; concurrent calls all return the first one's result.
func (s *Subscriber) Close() error {
	timeUp := time.AfterFunc(s.q.cfg.CloseTimeout, s.writeCancel)
	defer timeUp.Stop()
	return s.subs.Close(func() error {
		defer s.writeCancel()
		left, err := s.settler.Close()
		if err == nil {
			return nil
		}
		acks := 0
		for _, st := range left {
			if st.ack {
				acks++
			}
		}
		return fmt.Errorf("sqlqueue: close subscriber of consumer group %q: acknowledgements: %d, lease changes: %d not written (their messages are delivered again when the leases expire): %w",
			s.q.cfg.ConsumerGroup, acks, len(left)-acks, err)
	})
}

// subscription is the inflight.Source of one Subscribe call: it claims leases (Fetch) and
// hands their settlements to the Subscriber's settler (Settle, in delivery.go).
type subscription struct {
	s     *Subscriber
	q     *Queue
	topic string
	log   watermill.LoggerAdapter
	sub   *inflight.Subscription[leaseRef]
	// ackStmt is the statement of each delivery's redelivery.TxAck.
	ackStmt string

	// busy (Fetch's own, as are outage and dueAt): the last round claimed messages, so the
	// next claims at once, without probing.
	busy bool
	// outage is the run of claims that failed in a row.
	outage inflight.Outage
	// dueAt is when due leases were last looked for. A busy subscription looks for them once
	// per PollInterval, so that a backlog of new messages costs one claim per batch.
	dueAt time.Time
}

// Fetch claims up to n messages, due leases first, and emits them. It claims again after a
// conflict with another consumer at once, after a failure after RetryInterval, and with
// nothing to claim after PollInterval (or a Wake), until it has claimed something or ctx
// ends.
func (sub *subscription) Fetch(ctx context.Context, n int) error {
	cfg := sub.q.cfg
	for {
		// Taken before the claim, so that a Wake during the claim is not missed.
		woken := sub.q.wakes.Woken(sub.topic)
		got, err := sub.claim(ctx, n)
		if ctx.Err() != nil {
			return nil
		}
		sub.busy = err == nil && got > 0
		switch {
		case err != nil && sqldb.Classify(err) == sqldb.Conflict:
			// Another consumer claimed the same rows: claim again at once; what it took is
			// not there any more.
			sub.log.Debug("claim conflicted with another consumer; claiming again", watermill.LogFields{"err": err.Error()})
		case err != nil:
			// After a failure, wait out the interval, Wake or not.
			sub.outage.Failed(err, cfg.RetryInterval)
			dbqueue.Wait(ctx, cfg.RetryInterval, nil)
		case got > 0:
			sub.outage.Ended()
			return nil
		default:
			sub.outage.Ended()
			dbqueue.Wait(ctx, cfg.PollInterval, woken)
		}
	}
}

// claim claims up to n messages, due leases first, and emits them. An idle subscription
// first probes whether there is anything to claim. It returns how many it claimed.
func (sub *subscription) claim(ctx context.Context, n int) (int, error) {
	q := sub.q
	group, lease := q.cfg.ConsumerGroup, q.cfg.AckTimeout
	due, fresh := time.Since(sub.dueAt) >= q.cfg.PollInterval, true
	if !sub.busy {
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
		sub.dueAt = deadline.Add(-lease)
		rows, err := q.d.claimDue(ctx, q.db, sub.topic, group, n, lease)
		if err != nil {
			return 0, fmt.Errorf("claim due leases of topic %q: %w", sub.topic, err)
		}
		if len(rows) == n {
			sub.dueAt = time.Time{} // there may be more
		}
		claimed += len(rows)
		sub.emit(rows, deadline)
	}
	if fresh && claimed < n && ctx.Err() == nil {
		deadline := time.Now().Add(lease)
		rows, err := q.d.claimNew(ctx, q.db, sub.topic, group, n-claimed, lease)
		if err != nil {
			return claimed, fmt.Errorf("claim new messages of topic %q: %w", sub.topic, err)
		}
		claimed += len(rows)
		sub.emit(rows, deadline)
	}
	return claimed, nil
}

// emit makes the claimed rows deliveries, in order, whose leases run until deadline. A row
// whose message is gone (removed while leased) has its lease deleted; one claimed as the
// subscription stops is given back, its count as it was.
func (sub *subscription) emit(rows []row, deadline time.Time) {
	for _, r := range rows {
		ref := leaseRef{offset: r.offset, deliveries: r.deliveries}
		if r.orphan {
			sub.ack(ref)
			continue
		}
		it := inflight.Item[leaseRef]{Data: ref, Msg: newMessage(r.uuid, r.payload, r.metadata), Count: r.deliveries, Deadline: deadline}
		if sub.sub.Emit(it) == nil {
			sub.update(leaseUpdate{leaseRef: ref, delta: -1})
		}
	}
}

// Close has nothing to release: the Subscriber's settler writes what Settle gave it.
func (sub *subscription) Close(context.Context) error { return nil }
