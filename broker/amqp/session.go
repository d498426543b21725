package amqp

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/broker/redelivery"
)

var consumerSeq atomic.Uint64

// consumerTag returns a consumer tag unique in the process.
func consumerTag() string {
	return fmt.Sprintf("onceflow-%d-%d", os.Getpid(), consumerSeq.Add(1))
}

// delivery is one message a session received.
type delivery struct {
	tag    uint64
	msg    *message.Message
	ctx    context.Context // the message's context, with its redelivery state
	cancel context.CancelFunc
	due    time.Time // when a held nack is sent
	out    time.Time // when it was handed out
}

// settlement is the consumer's ack or nack of a delivery.
type settlement struct {
	d   *delivery
	ack bool
}

// session is a subscription's life on one AMQP channel. Its goroutine (run) owns its state and
// is the only one that sends acks and nacks on the channel, so that the frames go in the order
// the window decides; a goroutine per handed-out delivery waits for the consumer's ack or nack
// and reports it.
type session struct {
	sub        *subscription
	ch         *amqp.Channel
	acks       acker
	tag        string
	deliveries <-chan amqp.Delivery
	closed     <-chan *amqp.Error
	quorum     bool

	// ctx is the parent of the deliveries' contexts, cancelled when the session ends.
	ctx    context.Context
	cancel context.CancelFunc
	// done is closed when the session ends: the deliveries' goroutines stop waiting.
	done   chan struct{}
	events chan settlement

	acked    *coalescer
	inflight map[uint64]*delivery // handed out, not settled by the consumer
	held     heldQueue
	ackTimer *time.Timer
	ackDue   time.Time // when ackTimer fires; zero when it is stopped
	nackTime *time.Timer
}

func newSession(sub *subscription, ch *amqp.Channel, a acker, tag string, deliveries <-chan amqp.Delivery, closed <-chan *amqp.Error) *session {
	cfg := sub.s.cfg
	ctx, cancel := context.WithCancel(sub.ctx)
	ss := &session{
		sub:        sub,
		ch:         ch,
		acks:       a,
		tag:        tag,
		deliveries: deliveries,
		closed:     closed,
		quorum:     cfg.Topology.Queue.Type == Quorum,
		ctx:        ctx,
		cancel:     cancel,
		done:       make(chan struct{}),
		events:     make(chan settlement, cfg.Prefetch),
		acked:      newCoalescer(cfg.Prefetch, cfg.AckDelay, cfg.OutOfOrderAckDelay),
		inflight:   map[uint64]*delivery{},
		ackTimer:   time.NewTimer(time.Hour),
		nackTime:   time.NewTimer(time.Hour),
	}
	ss.ackTimer.Stop()
	ss.nackTime.Stop()
	return ss
}

// run hands out deliveries and settles them until the session ends. It reports true when the
// channel was lost (the subscription goes on with a new session), false when the subscription
// ended.
func (ss *session) run() (lost bool) {
	var next *delivery // received, not handed out yet
	defer func() {
		if next != nil {
			next.cancel()
		}
	}()
	for {
		// An end that is due goes before handing out a message that is ready too.
		if ss.sub.ctx.Err() != nil || ss.sub.s.stop.Err() != nil {
			ss.end()
			return false
		}
		var (
			in  <-chan amqp.Delivery
			out chan<- *message.Message
			msg *message.Message
		)
		if next == nil {
			in = ss.deliveries
		} else {
			out, msg = ss.sub.out, next.msg
		}
		var err error
		select {
		case d, ok := <-in:
			if !ok {
				ss.lose(errors.New("the consumer was cancelled or its channel closed"))
				return true
			}
			next = ss.receive(d)
		case out <- msg:
			ss.handOut(next)
			next = nil
		case st := <-ss.events:
			err = ss.settle(st)
		case now := <-ss.ackTimer.C:
			ss.ackDue = time.Time{}
			err = ss.send(ss.acked.expire(now))
		case <-ss.nackTime.C:
			err = ss.nackDue(time.Now())
		case e := <-ss.closed:
			if e == nil {
				ss.lose(errors.New("channel closed"))
			} else {
				ss.lose(e)
			}
			return true
		case <-ss.sub.ctx.Done():
			ss.end()
			return false
		case <-ss.sub.s.stop.Done():
			ss.end()
			return false
		}
		if err != nil {
			ss.lose(err)
			return true
		}
	}
}

// receive turns an AMQP delivery into a message whose context carries its redelivery.Info.
func (ss *session) receive(d amqp.Delivery) *delivery {
	msg, _ := Marshaler{}.Unmarshal(d) // never fails
	ctx, cancel := context.WithCancel(redelivery.NewContext(ss.ctx, deliveryInfo(d, ss.quorum)))
	msg.SetContext(ctx)
	ss.acked.deliver(d.DeliveryTag)
	return &delivery{tag: d.DeliveryTag, msg: msg, ctx: ctx, cancel: cancel}
}

// handOut records that the consumer has d and waits for its ack or nack.
func (ss *session) handOut(d *delivery) {
	ss.inflight[d.tag] = d
	d.out = time.Now()
	go func() {
		var st settlement
		select {
		case <-d.msg.Acked():
			st = settlement{d: d, ack: true}
		case <-d.msg.Nacked():
			st = settlement{d: d}
		case <-ss.done:
			return // the session is over: an ack now is dropped
		}
		select {
		case ss.events <- st:
		case <-ss.done:
		}
	}()
}

// settle handles the consumer's ack or nack of a delivery.
func (ss *session) settle(st settlement) error {
	d := st.d
	if ss.inflight[d.tag] != d {
		return nil // settled already, by the sweep of end
	}
	delete(ss.inflight, d.tag)
	d.cancel()
	if st.ack {
		now := time.Now()
		return ss.send(ss.acked.ack(d.tag, now, now.Sub(d.out)))
	}
	delay, asked := redelivery.RequestedDelay(d.ctx)
	if !asked {
		delay = ss.sub.s.cfg.NackDelay
	}
	if delay <= 0 {
		return ss.nack(d)
	}
	d.due = time.Now().Add(delay)
	heap.Push(&ss.held, d)
	ss.resetNackTimer()
	return ss.send(ss.acked.holdNack(d.tag))
}

// send sends the acks the coalescer returned, and sets the timer for the ones that wait.
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

// nack gives d back to RabbitMQ, to be delivered again.
func (ss *session) nack(d *delivery) error {
	if err := ss.acks.Nack(d.tag, false, true); err != nil {
		return fmt.Errorf("nack delivery %d: %w", d.tag, err)
	}
	return ss.send(ss.acked.settle(d.tag))
}

// nackDue sends the held nacks whose delay has passed at now.
func (ss *session) nackDue(now time.Time) error {
	for len(ss.held) > 0 && !ss.held[0].due.After(now) {
		if err := ss.nack(heap.Pop(&ss.held).(*delivery)); err != nil {
			return err
		}
	}
	ss.resetNackTimer()
	return nil
}

func (ss *session) resetNackTimer() {
	ss.nackTime.Stop()
	if len(ss.held) > 0 {
		ss.nackTime.Reset(time.Until(ss.held[0].due))
	}
}

// end ends the session because the subscription ends: it stops the consumer, sends every ack
// the consumer gave (also those not reported yet), gives held nacks back at once, and closes
// the channel, which gives back the deliveries not settled.
func (ss *session) end() {
	log := ss.sub.s.cfg.Logger
	fields := watermill.LogFields{"queue": ss.sub.queue}
	var errs []error
	if err := ss.ch.Cancel(ss.tag, false); err != nil {
		errs = append(errs, fmt.Errorf("cancel consumer: %w", err))
	}
	for drained := false; !drained; {
		select {
		case st := <-ss.events:
			errs = append(errs, ss.settle(st))
		default:
			drained = true
		}
	}
	for _, d := range ss.inflight {
		select {
		case <-d.msg.Acked():
			errs = append(errs, ss.settle(settlement{d: d, ack: true}))
		case <-d.msg.Nacked():
			errs = append(errs, ss.settle(settlement{d: d}))
		default:
		}
	}
	errs = append(errs, ss.send(ss.acked.flush()))
	for len(ss.held) > 0 {
		errs = append(errs, ss.nack(heap.Pop(&ss.held).(*delivery)))
	}
	ss.stopSession()
	if err := ss.ch.Close(); err != nil && !errors.Is(err, amqp.ErrClosed) {
		errs = append(errs, fmt.Errorf("close channel: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		log.Error("Subscription ended uncleanly; RabbitMQ redelivers what was not settled", err, fields)
	}
}

// lose ends the session because its channel or connection was lost: the deliveries' contexts
// are cancelled, and acks not sent are dropped (RabbitMQ gives the deliveries of a closed
// channel back).
func (ss *session) lose(err error) {
	ss.sub.s.cfg.Logger.Error("Subscription lost its channel; reconnecting", err, watermill.LogFields{"queue": ss.sub.queue})
	ss.stopSession()
	if !ss.ch.IsClosed() {
		_ = ss.ch.Close()
	}
}

// stopSession cancels the deliveries' contexts, stops the timers and the deliveries'
// goroutines.
func (ss *session) stopSession() {
	ss.cancel()
	ss.ackTimer.Stop()
	ss.nackTime.Stop()
	close(ss.done)
}

// deliveryInfo returns what the broker says of d's deliveries: on a quorum queue, the count
// from the header x-delivery-count, which RabbitMQ sets on every delivery after the first to
// the number of earlier ones; on a classic queue, the redelivered flag.
func deliveryInfo(d amqp.Delivery, quorum bool) redelivery.Info {
	info := redelivery.Info{DelaysNacks: true}
	if quorum {
		if n, ok := deliveryCount(d.Headers[HeaderDeliveryCount]); ok {
			info.Count = n + 1
			return info
		}
		if !d.Redelivered {
			info.Count = 1
			return info
		}
	}
	info.Redelivered = d.Redelivered
	return info
}

// deliveryCount reads the x-delivery-count header, an integer that RabbitMQ sets (a string one
// comes from a producer, and is not trusted).
func deliveryCount(v any) (int, bool) {
	var n int64
	switch v := v.(type) {
	case int64:
		n = v
	case int32:
		n = int64(v)
	case int16:
		n = int64(v)
	case int8:
		n = int64(v)
	case int:
		n = int64(v)
	case uint8:
		n = int64(v)
	case uint16:
		n = int64(v)
	case uint32:
		n = int64(v)
	default:
		return 0, false
	}
	if n < 0 || n > 1<<31 {
		return 0, false
	}
	return int(n), true
}

// heldQueue is a min-heap of held deliveries by due time.
type heldQueue []*delivery

func (h heldQueue) Len() int           { return len(h) }
func (h heldQueue) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h heldQueue) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *heldQueue) Push(x any)        { *h = append(*h, x.(*delivery)) }
func (h *heldQueue) Pop() any {
	old := *h
	d := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return d
}
