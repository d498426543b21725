package amqp

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// errConsumerGone loses a session whose deliveries channel amqp091-go closed.
var errConsumerGone = errors.New("the consumer was cancelled or its channel closed")

// subscription is the RabbitMQ side of one Subscribe call (an inflight.Source), a consumer of
// one queue that outlives the channels it consumes on: it takes the deliveries RabbitMQ pushes
// (basic.qos is the window), settles them with coalesced acks and nacks on their channel
// (session), and opens a new channel when one is lost.
type subscription struct {
	s     *Subscriber
	topic string
	queue string
	// prefetch is the subscription's window (Config.Prefetch, or inflight.Rules.Window).
	prefetch int
	log      watermill.LoggerAdapter
	sub      *inflight.Subscription[tag]

	// ss is the current session: Fetch replaces a lost one, Close ends the last.
	ss atomic.Pointer[session]
}

// tag is what a delivery keeps of its AMQP delivery: its tag on its session's channel.
type tag struct {
	ss  *session
	tag uint64
}

// open opens a channel, declares the topology and starts consuming on it.
func (sub *subscription) open() (*session, error) {
	s := sub.s
	conn, err := s.connection()
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	fail := func(err error) (*session, error) {
		_ = ch.Close()
		return nil, err
	}
	if err := ch.Qos(sub.prefetch, 0, false); err != nil {
		return fail(fmt.Errorf("set prefetch %d: %w", sub.prefetch, err))
	}
	if err := s.cfg.Topology.Declare(ch, sub.topic); err != nil {
		return fail(err)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	consumer := consumerTag()
	deliveries, err := ch.Consume(sub.queue, consumer, false, false, false, false, nil)
	if err != nil {
		return fail(fmt.Errorf("consume queue %q: %w", sub.queue, err))
	}
	ss := &session{
		ch:         ch,
		acks:       ch,
		consumer:   consumer,
		deliveries: deliveries,
		closed:     closed,
		quorum:     s.cfg.Topology.Queue.Type == Quorum,
		idle:       make(chan struct{}, 1),
		done:       make(chan struct{}),
		acked:      newCoalescer(sub.prefetch, s.cfg.AckDelay, s.cfg.OutOfOrderAckDelay),
	}
	if s.wrapAcker != nil {
		ss.acks = s.wrapAcker(ss.acks)
	}
	ss.failed, ss.fail = context.WithCancelCause(context.Background())
	ss.ackTimer = time.AfterFunc(time.Hour, ss.expire)
	ss.ackTimer.Stop()
	return ss, nil
}

// Fetch waits for the first delivery RabbitMQ pushes and takes those that are there after it,
// up to n. On a lost session it opens a new one first. While it waits, it sends the acks that
// wait for want of an open delivery (session.idle), unless a delivery came meanwhile.
func (sub *subscription) Fetch(ctx context.Context, n int) error {
	ss := sub.ss.Load()
	if ss.isOver() {
		if ss = sub.reopen(); ss == nil {
			return nil
		}
	}
	for got := 0; got < n; {
		var d amqp.Delivery
		var ok bool
		select {
		case d, ok = <-ss.deliveries:
		default:
			if got > 0 {
				return nil
			}
			select {
			case d, ok = <-ss.deliveries:
			case <-ss.idle:
				// The consumer settled every delivery it has. RabbitMQ may have sent the
				// next already: take it first if it is there (let amqp091-go's goroutine
				// pass it on), and the acks go with the next ones, in fewer frames.
				runtime.Gosched()
				select {
				case d, ok = <-ss.deliveries:
				default:
					ss.sendNow((*coalescer).idleFlush)
					continue
				}
			case <-ss.done:
				return nil
			case <-ctx.Done():
				return nil
			}
		}
		if !sub.take(ss, d, ok) {
			return nil
		}
		got++
	}
	return nil
}

// take makes d a delivery, or, when the deliveries channel is closed (ok false), loses the
// session; it reports whether the session goes on.
func (sub *subscription) take(ss *session, d amqp.Delivery, ok bool) bool {
	if !ok {
		sub.lose(ss, errConsumerGone)
		return false
	}
	msg, _ := Marshaler{}.Unmarshal(d) // never fails
	if !ss.deliver(d.DeliveryTag) {
		return false // lost: RabbitMQ gives it back
	}
	count, redelivered := deliveryCount(d, ss.quorum)
	x := sub.sub.Emit(inflight.Item[tag]{Data: tag{ss: ss, tag: d.DeliveryTag}, Msg: msg, Count: count, Redelivered: redelivered})
	if x != nil && ss.isOver() {
		// Lost as it came: the end of the session's deliveries may have passed it by.
		sub.sub.End(ErrConnectionLost, func(y *inflight.Delivery[tag]) bool { return y == x })
	}
	return true
}

// Settle sends a delivery's settlement on its channel, or nothing when that channel is gone
// (RabbitMQ gives the message back): an ack to the coalescer, a nack at once (the engine has
// held it for its delay), a nack whose hold begins to the coalescer's window (acks cannot
// cover it). A delivery the end of the subscription gives back is settled once the consumer
// is cancelled (Close); one neither acked nor nacked is given back by the channel's close.
func (sub *subscription) Settle(d *inflight.Delivery[tag], o inflight.Outcome) {
	ss, t := d.Data.ss, d.Data.tag
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.over || !o.Acked && !o.Nacked {
		return
	}
	if sub.sub.Stopped() && !o.Held {
		ss.atEnd = append(ss.atEnd, endSettlement{tag: t, ack: o.Acked})
		return
	}
	var err error
	switch {
	case o.Held:
		ss.acked.nack(t, held)
		err = ss.send(nil)
	case o.Acked:
		now := time.Now()
		var took time.Duration
		if !o.HandedOut.IsZero() {
			took = now.Sub(o.HandedOut)
		}
		err = ss.send(ss.acked.ack(t, now, took))
	default:
		err = ss.nack(t)
	}
	if err != nil {
		ss.fail(err)
		return
	}
	if ss.acked.idleDue() {
		inflight.Signal(ss.idle)
	}
}

// Flush sends the acks at the front of the window at once (redelivery.Flush): their
// deliveries leave RabbitMQ's prefetch window now, instead of after AckDelay, for the next ones.
func (sub *subscription) Flush() { sub.ss.Load().sendNow((*coalescer).flushPrefix) }

// Close ends the last session (session.end), within ctx: when RabbitMQ does not answer, the
// Subscriber's Close drops the connection.
func (sub *subscription) Close(ctx context.Context) error {
	ss := sub.ss.Load()
	done := make(chan error, 1)
	go func() { done <- ss.end() }()
	select {
	case err := <-done:
		if err != nil {
			sub.log.Error("Subscription ended uncleanly; RabbitMQ redelivers what was not settled", err, nil)
		}
		return nil
	case <-ctx.Done():
		sub.s.dropped.Store(true)
		return fmt.Errorf("the subscription to queue %q did not end within %s: connection dropped", sub.queue, sub.s.cfg.CloseTimeout)
	}
}

// watch loses ss when its channel closes or a settlement could not be sent on it, until the
// session is over or the subscription ends.
func (sub *subscription) watch(ss *session) {
	select {
	case e := <-ss.closed:
		err := error(e)
		if e == nil {
			err = errors.New("channel closed")
		}
		sub.lose(ss, err)
	case <-ss.failed.Done():
		sub.lose(ss, context.Cause(ss.failed))
	case <-ss.done:
	case <-sub.sub.Stopping():
	}
}

// lose ends ss because its channel or connection was lost: its deliveries end
// (ErrConnectionLost), and acks not sent are dropped (RabbitMQ gives the deliveries of a closed
// channel back). The next Fetch opens a new session.
func (sub *subscription) lose(ss *session, err error) {
	if !ss.stop() {
		return
	}
	sub.log.Error("Subscription lost its channel; reconnecting", err, nil)
	sub.sub.End(ErrConnectionLost, func(d *inflight.Delivery[tag]) bool { return d.Data.ss == ss })
	if !ss.ch.IsClosed() {
		_ = ss.ch.Close()
	}
}

// reopen opens a new session after a loss, with exponential backoff; nil when the
// subscription ends first.
func (sub *subscription) reopen() *session {
	cfg := sub.s.cfg
	wait := cfg.ReconnectInitial
	for attempt := 1; ; attempt++ {
		if !sleep(wait, sub.sub.Stopping()) {
			return nil
		}
		ss, err := sub.open()
		if err == nil {
			sub.log.Info("Subscription resumed", watermill.LogFields{"attempt": attempt})
			sub.ss.Store(ss)
			go sub.watch(ss)
			return ss
		}
		if errors.Is(err, ErrClosed) {
			return nil
		}
		sub.log.Error("Cannot resume subscription", err, watermill.LogFields{"attempt": attempt})
		wait = min(2*wait, cfg.ReconnectMax)
	}
}
