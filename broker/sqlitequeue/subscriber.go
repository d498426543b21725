package sqlitequeue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/sqldb"
)

// deliveryKey is the context key under which a delivered message's context carries its
// *delivery.
type deliveryKey struct{}

// delivery is one delivery of a message: the subscriber transaction it happens in, and the
// queue file that transaction belongs to. Publishers write in tx through use until the
// subscriber ends the delivery.
type delivery struct {
	store *store
	tx    *sql.Tx
	uuid  string

	mu    sync.Mutex // serialises the statements of publishers and of end
	ended bool
}

// use runs fn with the delivery's transaction, unless the delivery has ended.
func (d *delivery) use(fn func(tx *sql.Tx) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ended {
		return ErrDeliveryEnded
	}
	return fn(d.tx)
}

// end ends the delivery: fn runs after every publish in progress and before any later one,
// which fails.
func (d *delivery) end(fn func(tx *sql.Tx)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ended = true
	fn(d.tx)
}

// savepoint is set before each delivery and rolled back to when the delivery is nacked or not
// acknowledged in time, so that what was published in the delivery's transaction during a
// failed attempt is undone. watermill-sql itself undoes nothing on nack.
const savepoint = "onceflow_delivery"

// deadlineMargin is how much longer than the configured AckDeadline the watermill-sql
// subscriber waits for an acknowledgement: the queue's own deadline must fire first, so that
// the attempt's savepoint is rolled back before watermill-sql commits the transaction.
func deadlineMargin(ackDeadline time.Duration) time.Duration {
	return min(time.Second, ackDeadline/2)
}

// subscriber is the Queue's message.Subscriber: a watermill-sql Subscriber whose deliveries
// carry their transaction for the queue's publishers, each inside a savepoint.
//
// It hands the consumer a copy of each message that watermill-sql delivers and relays the
// copy's ack or nack only after it has released or rolled back the delivery's savepoint.
// watermill-sql runs no statement in the transaction while a delivery is pending, so the
// savepoint statements never interleave with its own, and the outcome of an attempt is settled
// in the transaction before watermill-sql writes the offset or commits.
type subscriber struct {
	q      *Queue
	logger watermill.LoggerAdapter

	mu      sync.Mutex // guards closed, subs and cancels, and orders Subscribe before Close
	closed  bool
	subs    []*wsql.Subscriber   // one per subscription: each has its own subscriptionDB
	cancels []context.CancelFunc // of the subscriptions' contexts
	closing chan struct{}
	running sync.WaitGroup // forward goroutines
}

// closeGrace is how long Close lets the watermill-sql subscriptions finish by themselves (commit
// the offsets acknowledged so far) before it cancels their contexts, which ends a wait for the
// write lock that another process holds.
const closeGrace = time.Second

var (
	_ message.Subscriber           = (*subscriber)(nil)
	_ message.SubscribeInitializer = (*subscriber)(nil)
)

func newSubscriber(q *Queue) *subscriber {
	return &subscriber{q: q, logger: q.cfg.Logger, closing: make(chan struct{})}
}

// newSubscription returns the watermill-sql subscriber of one subscription.
func (s *subscriber) newSubscription() (*wsql.Subscriber, error) {
	cfg := s.q.cfg
	deadline := cfg.AckDeadline + deadlineMargin(cfg.AckDeadline)
	db := &subscriptionDB{DB: rawDB(s.q.db), store: s.q.store, backoff: backoff{poll: cfg.PollInterval, retry: cfg.RetryInterval}}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:    cfg.ConsumerGroup,
		AckDeadline:      &deadline,
		PollInterval:     cfg.PollInterval,
		ResendInterval:   cfg.ResendInterval,
		RetryInterval:    cfg.RetryInterval,
		BackoffManager:   db,
		SchemaAdapter:    s.q.schema,
		OffsetsAdapter:   s.q.offsets,
		InitializeSchema: false, // Subscribe prepares the topic itself, without the write lock when it can
	}, s.logger)
	if err != nil {
		return nil, fmt.Errorf("sqlitequeue: new subscriber: %w", err)
	}
	return sub, nil
}

// Subscribe starts one consumer of topic and returns its messages. See Queue.Subscriber for
// the delivery guarantees. The channel is closed when ctx is done or the subscriber closes.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := CheckTopic(topic); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	if err := s.q.prepareTopic(ctx, topic, s.q.cfg.ConsumerGroup); err != nil {
		return nil, err
	}
	sub, err := s.newSubscription()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	in, err := sub.Subscribe(ctx, topic)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("sqlitequeue: subscribe to topic %q: %w", topic, err)
	}
	s.subs = append(s.subs, sub)
	s.cancels = append(s.cancels, cancel)
	out := make(chan *message.Message)
	s.running.Add(1)
	go s.forward(ctx, topic, in, out)
	return out, nil
}

// forward hands the deliveries of in to out until in closes, ctx is done or the subscriber
// closes.
func (s *subscriber) forward(ctx context.Context, topic string, in <-chan *message.Message, out chan<- *message.Message) {
	defer s.running.Done()
	defer close(out)
	logger := s.logger.With(watermill.LogFields{"topic": topic, "consumer_group": s.q.cfg.ConsumerGroup})
	for {
		select {
		case msg, ok := <-in:
			if !ok || !s.deliver(ctx, logger, msg, out) {
				return
			}
		case <-s.closing:
			return
		case <-ctx.Done():
			return
		}
	}
}

// deliver hands one delivery to the consumer inside a savepoint and relays its outcome. It
// reports whether forwarding goes on.
func (s *subscriber) deliver(ctx context.Context, logger watermill.LoggerAdapter, msg *message.Message, out chan<- *message.Message) bool {
	logger = logger.With(watermill.LogFields{"msg_uuid": msg.UUID})
	tx, ok := wsql.TxFromContext(msg.Context())
	if !ok {
		// Not expected: every watermill-sql delivery carries its transaction.
		logger.Error("Message delivered without its transaction; nacking it", nil, nil)
		msg.Nack()
		return true
	}
	if _, err := tx.ExecContext(ctx, "SAVEPOINT "+savepoint); err != nil {
		if ctx.Err() != nil {
			return false
		}
		// The transaction is unusable; do not deliver without a savepoint. watermill-sql
		// tries again after ResendInterval, until its ack deadline ends the transaction.
		logger.Error("Cannot set the delivery savepoint; nacking the message", err, nil)
		msg.Nack()
		return true
	}

	// The copy's context ends at the queue's ack deadline, or earlier with the delivery.
	// watermill-sql's deadline counts from the message's first delivery in this transaction,
	// across nacks and redeliveries; the queue's ends deadlineMargin before it.
	deadline := time.Now().Add(s.q.cfg.AckDeadline)
	if dl, ok := msg.Context().Deadline(); ok {
		deadline = dl.Add(-deadlineMargin(s.q.cfg.AckDeadline))
	}
	dctx, cancel := context.WithDeadline(msg.Context(), deadline)
	defer cancel()
	d := &delivery{store: s.q.store, tx: tx, uuid: msg.UUID}
	cp := msg.Copy()
	cp.SetContext(context.WithValue(dctx, deliveryKey{}, d))
	undo := func() { d.end(func(tx *sql.Tx) { s.undo(tx, logger) }) }

	select {
	case out <- cp:
	case <-s.closing:
		undo()
		return false
	case <-ctx.Done():
		return false
	case <-dctx.Done():
		undo()
		return true
	}

	select {
	case <-cp.Acked():
		d.end(func(tx *sql.Tx) {
			if _, err := tx.ExecContext(ctx, "RELEASE "+savepoint); err != nil {
				// The offset update that follows fails too, and the batch is delivered again.
				logger.Error("Cannot release the delivery savepoint", err, nil)
			}
		})
		msg.Ack()
		return true
	case <-cp.Nacked():
		undo()
		msg.Nack()
		return true
	case <-s.closing:
		undo()
		return false
	case <-ctx.Done():
		// database/sql rolls the transaction back.
		d.end(func(*sql.Tx) {})
		return false
	case <-dctx.Done():
		// Ack deadline, or watermill-sql ended the delivery. watermill-sql ends the
		// transaction by itself and delivers the message again later.
		logger.Info("Message not acknowledged within the ack deadline; it will be delivered again", watermill.LogFields{"ack_deadline": s.q.cfg.AckDeadline})
		undo()
		return true
	}
}

// undo rolls tx back to the delivery's savepoint and removes the savepoint.
func (s *subscriber) undo(tx *sql.Tx, logger watermill.LoggerAdapter) {
	// Not under the subscription's context: the rollback must run even when that context is
	// done (and if the transaction is done, there is nothing left to undo).
	ctx := context.Background()
	_, err := tx.ExecContext(ctx, "ROLLBACK TO "+savepoint)
	if err == nil {
		_, err = tx.ExecContext(ctx, "RELEASE "+savepoint)
	}
	if err != nil && !errors.Is(err, sql.ErrTxDone) {
		logger.Error("Cannot roll back to the delivery savepoint", err, nil)
	}
}

// SubscribeInitialize creates topic's tables.
func (s *subscriber) SubscribeInitialize(topic string) error {
	if err := CheckTopic(topic); err != nil {
		return err
	}
	return s.q.prepareTopic(context.Background(), topic, s.q.cfg.ConsumerGroup)
}

// Close ends the subscriber's subscriptions and waits for them: a message delivered and not yet
// acknowledged is rolled back into the queue. Close is idempotent.
func (s *subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closing)
	subs, cancels := s.subs, s.cancels
	s.mu.Unlock()

	// Forwarders first: each rolls back its pending delivery's savepoint before watermill-sql,
	// closing, commits the offsets acknowledged so far.
	s.running.Wait()
	done := make(chan error, 1)
	go func() {
		var errs []error
		for _, sub := range subs {
			errs = append(errs, sub.Close())
		}
		done <- errors.Join(errs...)
	}()
	var err error
	select {
	case err = <-done:
	case <-time.After(closeGrace):
		for _, cancel := range cancels {
			cancel()
		}
		err = <-done
	}
	for _, cancel := range cancels {
		cancel()
	}
	s.q.forget(s)
	return err
}

// backoff computes how long a subscription waits before its next query: the poll interval when
// nothing was found or the database was busy, the retry interval after other errors, and
// batchYield after a batch.
type backoff struct {
	poll, retry time.Duration
}

// batchYield is the pause of a consumer after each batch. Writers of this process get their
// turns in order anyway (see store); the pause is for writers of other processes, which SQLite
// lets try the lock only every 100 ms or so once they have waited a while, and which would
// otherwise almost never find it free until the consumer's backlog is gone. Measured with a
// backlog and a 0.5 ms handler: a publisher in another process waited up to 7 s without the
// pause and up to about 2 s with it, at a cost of about 1 ms per batch.
const batchYield = time.Millisecond

// HandleError returns how long the subscription waits before its next query.
func (b backoff) HandleError(logger watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	switch {
	case err == nil && noMsg:
		return b.poll
	case err == nil:
		return batchYield
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		logger.Debug("Query ended by its context", watermill.LogFields{"err": err.Error()})
		return b.poll
	case sqldb.Classify(err) == sqldb.Conflict:
		logger.Info("Queue database busy, trying again", watermill.LogFields{"err": err.Error()})
		return b.poll
	}
	logger.Error("Cannot query the queue", err, watermill.LogFields{"wait_time": b.retry})
	return b.retry
}
