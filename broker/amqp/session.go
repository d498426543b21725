package amqp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

var consumerSeq atomic.Uint64

// consumerTag returns a consumer tag unique in the process.
func consumerTag() string {
	return fmt.Sprintf("onceflow-%d-%d", os.Getpid(), consumerSeq.Add(1))
}

// session is a subscription's life on one AMQP channel: the deliveries of its consumer, and
// the frames that settle them, sent only under mu, in the order the window decides. A session
// is over when its channel is lost or the subscription ends: nothing is sent on it after,
// since tags belong to their channel.
type session struct {
	ch         *amqp.Channel
	acks       acker
	consumer   string // the consumer tag
	deliveries <-chan amqp.Delivery
	closed     <-chan *amqp.Error
	quorum     bool

	// failed ends, with the first error of sending a settlement as its cause, when a
	// settlement could not be sent (fail, mu held): the subscription then loses the channel.
	failed context.Context
	fail   context.CancelCauseFunc
	// idle is signalled when acks wait and no delivery is open: the fetch sends them unless
	// the next delivery is at hand.
	idle chan struct{}
	// done is closed when the session is over.
	done chan struct{}

	mu    sync.Mutex
	over  bool
	acked *coalescer
	// ackTimer sends the acks that waited their time, at ackDue (zero when it is stopped).
	ackTimer *time.Timer
	ackDue   time.Time
	// atEnd are the settlements the end of the subscription gives back: they are sent once
	// the consumer is cancelled, so that RabbitMQ does not fill the room they free.
	atEnd []endSettlement
}

// endSettlement is the ack or nack of one tag that the end of a subscription sends.
type endSettlement struct {
	tag uint64
	ack bool
}

// deliver records the delivery of tag, and reports false when the session is over (RabbitMQ
// gives the message back).
func (ss *session) deliver(tag uint64) bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if !ss.over {
		ss.acked.win.add(tag)
	}
	return !ss.over
}

// isOver reports whether the session is over.
func (ss *session) isOver() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.over
}

// stop makes the session over, and reports false when it was already.
func (ss *session) stop() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.stopLocked()
}

func (ss *session) stopLocked() bool {
	if ss.over {
		return false
	}
	ss.over = true
	ss.ackTimer.Stop()
	close(ss.done)
	return true
}

// expire sends the acks that have waited their time: the ack timer's function.
func (ss *session) expire() {
	ss.sendNow(func(c *coalescer) []ackFrame {
		ss.ackDue = time.Time{}
		return c.expire(time.Now())
	})
}

// sendNow sends the frames that take returns, unless the session is over.
func (ss *session) sendNow(take func(*coalescer) []ackFrame) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.over {
		return
	}
	if err := ss.send(take(ss.acked)); err != nil {
		ss.fail(err)
	}
}

// send sends the acks the coalescer returned, and sets the timer for the ones that wait. mu is
// held.
func (ss *session) send(frames []ackFrame) error {
	for _, f := range frames {
		if err := ss.acks.Ack(f.tag, f.multiple); err != nil {
			return fmt.Errorf("ack delivery %d (multiple=%t): %w", f.tag, f.multiple, err)
		}
	}
	due, ok := ss.acked.due()
	switch {
	case !ok:
		if !ss.ackDue.IsZero() {
			ss.ackTimer.Stop()
			ss.ackDue = time.Time{}
		}
	case !due.Equal(ss.ackDue):
		ss.ackTimer.Reset(time.Until(due))
		ss.ackDue = due
	}
	return nil
}

// nack gives the message of tag back to RabbitMQ, to be delivered again. mu is held.
func (ss *session) nack(tag uint64) error {
	if err := ss.acks.Nack(tag, false, true); err != nil {
		return fmt.Errorf("nack delivery %d: %w", tag, err)
	}
	ss.acked.nack(tag, gone)
	return ss.send(nil)
}

// end ends the session as its subscription ends, unless it was lost before: it cancels the
// consumer, sends the settlements of the end and every ack waiting, and closes the channel,
// which gives back what was not settled and what RabbitMQ sent ahead.
func (ss *session) end() error {
	if ss.isOver() {
		return nil
	}
	var errs []error
	if err := ss.ch.Cancel(ss.consumer, false); err != nil {
		errs = append(errs, fmt.Errorf("cancel consumer: %w", err))
	}
	ss.mu.Lock()
	if !ss.over {
		errs = append(errs, ss.sendAtEnd())
		ss.stopLocked()
	}
	ss.mu.Unlock()
	if err := ss.ch.Close(); err != nil && !errors.Is(err, amqp.ErrClosed) {
		errs = append(errs, fmt.Errorf("close channel: %w", err))
	}
	return errors.Join(errs...)
}

// sendAtEnd sends the nacks and acks of the end, then every ack waiting, until a frame fails.
// mu is held.
func (ss *session) sendAtEnd() error {
	now := time.Now()
	for _, e := range ss.atEnd {
		var err error
		if e.ack {
			err = ss.send(ss.acked.ack(e.tag, now, 0))
		} else {
			err = ss.nack(e.tag)
		}
		if err != nil {
			return err
		}
	}
	return ss.send(ss.acked.flush())
}
