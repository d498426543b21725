package outbox

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/sqldb"
)

// relaySubscriber is the subscriber that the forwarder's router consumes: the outbox's
// subscriber (watermill-sql's, or sqliteSubscriber), made to stop without sending again what
// it has sent.
//
// The inner subscriber reads a batch, delivers its messages one at a time, and writes the
// offset of the last acknowledged one when the batch ends (watermill-sql's in the batch's
// transaction, just before the commit). It runs under the subscription's context, and
// watermill's router cancels that context as soon as it starts closing: the offset write then
// fails (database/sql even rolls watermill-sql's transaction back at once), and every message
// of the batch sent so far is sent again by the next relay. relaySubscriber subscribes with a
// context of its own, which only kill cancels, and its Close lets the message in flight finish
// before it closes the inner subscriber, which then records the offsets acknowledged so far.
type relaySubscriber struct {
	inner   message.Subscriber // watermill-sql's, or sqliteSubscriber
	ctx     context.Context    // of the subscription; ends only with kill
	timeout time.Duration      // how long Close waits for the message in flight

	mu       sync.Mutex
	stopped  bool
	inflight *message.Message

	// moved receives a token when the inner subscriber has moved on after the message in
	// flight: it delivered another message, or its poll ended (the backoff reports it).
	moved chan struct{}

	stopping  chan struct{} // closed when Close begins
	closeOnce sync.Once
	closed    chan struct{} // closed when Close has finished
	closeErr  error
}

var _ message.Subscriber = (*relaySubscriber)(nil)

func newRelaySubscriber(inner message.Subscriber, ctx context.Context, timeout time.Duration) *relaySubscriber {
	return &relaySubscriber{inner: inner, ctx: ctx, timeout: timeout,
		moved: make(chan struct{}, 1), stopping: make(chan struct{}), closed: make(chan struct{})}
}

// signalMoved records that the inner subscriber has moved on.
func (s *relaySubscriber) signalMoved() {
	select {
	case s.moved <- struct{}{}:
	default:
	}
}

// Subscribe subscribes to topic with the subscriber's own context; the router's is ignored.
func (s *relaySubscriber) Subscribe(_ context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	stopped := s.stopped
	s.mu.Unlock()
	if stopped {
		return nil, ErrClosed
	}
	in, err := s.inner.Subscribe(s.ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go s.forward(in, out)
	return out, nil
}

// forward hands the messages of in to out until in closes. Once Close has begun it hands over
// nothing more: the inner subscriber then sees the message neither acked nor nacked, and
// leaves it for the next relay.
func (s *relaySubscriber) forward(in <-chan *message.Message, out chan<- *message.Message) {
	defer close(out)
	for msg := range in {
		s.signalMoved()
		s.mu.Lock()
		if s.stopped {
			s.mu.Unlock()
			continue
		}
		s.inflight = msg
		select { // the inner subscriber waits for this message: nothing moves until it is settled
		case <-s.moved:
		default:
		}
		s.mu.Unlock()
		out <- msg // the router reads its subscription until it is closed
	}
}

// Close stops handing over messages, waits up to the timeout for the message in flight to be
// acked or nacked, then closes the inner subscriber, which records the offset of the last
// acknowledged message. It is idempotent; every call returns when the first has finished.
//
// After an ack it also waits for the inner subscriber to take the ack in: watermill-sql
// selects on the ack and on its closing signal at once, and were both ready, it could take
// either and forget the ack. It has taken the ack when it delivers the next message or its
// poll ends.
func (s *relaySubscriber) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.stopped = true
		msg := s.inflight
		s.mu.Unlock()
		close(s.stopping)
		if msg != nil {
			timer := time.NewTimer(s.timeout)
			select {
			case <-msg.Acked():
				select {
				case <-s.moved:
				case <-timer.C:
				case <-s.ctx.Done():
				}
			case <-msg.Nacked():
			case <-timer.C:
			case <-s.ctx.Done():
			}
			timer.Stop()
		}
		s.closeErr = s.inner.Close()
		close(s.closed)
	})
	<-s.closed
	return s.closeErr
}

// halt stops handing over messages at once, as a crashed process would.
func (s *relaySubscriber) halt() {
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
}

// backoff is the relay's watermill-sql BackoffManager: how long to wait before the next poll.
type backoff struct {
	poll, retry time.Duration
	logger      *slog.Logger
	polls       atomic.Int64 // polls that have ended, for tests
	ended       func()       // called when a poll has ended
}

// HandleError logs a failed poll at a level that fits its cause and returns the wait.
func (b *backoff) HandleError(_ watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	b.polls.Add(1)
	if b.ended != nil {
		b.ended()
	}
	switch {
	case err == nil && noMsg:
		return b.poll
	case err == nil:
		return 0 // more may be waiting
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		b.logger.Debug("outbox relay: poll ended by its context", "error", err)
		return b.poll
	case sqldb.Classify(err) == sqldb.Conflict:
		// Another relay of the group holds the offsets (PostgreSQL reports a serialization
		// failure once it commits, MySQL a deadlock or lock wait timeout) or the database is
		// busy: this relay tries again later.
		b.logger.Debug("outbox relay: another relay of the group is sending; polling again later", "error", err)
		return b.poll
	}
	b.logger.Error("outbox relay: cannot read the outbox", "error", err, "retry_in", b.retry)
	return b.retry
}
