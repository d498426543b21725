package amqp

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
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

// session is a subscription's life on one AMQP channel. Its goroutine (run) receives and hands
// out the deliveries. Its state (the window, the deliveries handed out, the held nacks and the
// timers) is guarded by mu, and acks and nacks are sent only under mu, so that the frames go in
// the order the window decides.
//
// A consumer that settles directly (redelivery.SettlesDirectly) settles each delivery in its
// own goroutine, under mu, when it calls redelivery.Settle. For any other consumer a goroutine
// per handed-out delivery waits for its ack or nack and reports it to run on events.
type session struct {
	sub        *subscription
	ch         *amqp.Channel
	acks       acker
	tag        string
	deliveries <-chan amqp.Delivery
	closed     <-chan *amqp.Error
	quorum     bool
	// direct: the consumer calls redelivery.Settle after each ack or nack.
	direct bool

	// ctx is the parent of the deliveries' contexts, cancelled when the session ends.
	ctx    context.Context
	cancel context.CancelFunc
	// done is closed when the session ends: the deliveries' goroutines stop waiting.
	done   chan struct{}
	events chan settlement
	// failed is signalled when a direct settlement could not be sent: run then loses the
	// channel.
	failed chan struct{}
	// idle is signalled when a direct settlement left acks waiting and no delivery open: run
	// sends them unless it has the next delivery at hand.
	idle chan struct{}

	mu sync.Mutex
	// over is set when the session ends: a settlement after it changes nothing, and its ack is
	// dropped (never sent on another channel).
	over bool
	// err is the first error of sending a direct settlement.
	err   error
	acked *coalescer
	// inflight holds the deliveries handed out and not settled by the consumer; for a consumer
	// that settles directly, from their receipt on.
	inflight map[uint64]*delivery
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
		direct:     redelivery.SettlesDirectly(sub.ctx),
		ctx:        ctx,
		cancel:     cancel,
		done:       make(chan struct{}),
		events:     make(chan settlement, cfg.Prefetch),
		failed:     make(chan struct{}, 1),
		idle:       make(chan struct{}, 1),
		acked:      newCoalescer(cfg.Prefetch, cfg.AckDelay, cfg.OutOfOrderAckDelay),
		inflight:   map[uint64]*delivery{},
		ackTimer:   time.NewTimer(time.Hour),
		nackTime:   time.NewTimer(time.Hour),
	}
	ss.ackTimer.Stop()
	ss.nackTime.Stop()
	ss.acked.deferIdle = ss.direct
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
			ss.mu.Lock()
			err = ss.settle(st)
			ss.mu.Unlock()
		case <-ss.failed:
			ss.mu.Lock()
			err = ss.err
			ss.mu.Unlock()
		case <-ss.idle:
			// The consumer settled every delivery it has. Sending the acks now takes a frame
			// for the few acked so far, while RabbitMQ may have sent the next delivery
			// already: take it first if it is there, and they go with the next ones.
			if next == nil {
				// The goroutine of amqp091-go that passes the deliveries on may not be
				// waiting to pass the next one yet: let it run first.
				runtime.Gosched()
				select {
				case d, ok := <-ss.deliveries:
					if !ok {
						ss.lose(errors.New("the consumer was cancelled or its channel closed"))
						return true
					}
					next = ss.receive(d)
					continue
				default:
				}
			}
			ss.mu.Lock()
			err = ss.send(ss.acked.idleFlush())
			ss.mu.Unlock()
		case now := <-ss.ackTimer.C:
			ss.mu.Lock()
			ss.ackDue = time.Time{}
			err = ss.send(ss.acked.expire(now))
			ss.mu.Unlock()
		case <-ss.nackTime.C:
			ss.mu.Lock()
			err = ss.nackDue(time.Now())
			if err == nil {
				err = ss.send(ss.acked.idleFlush()) // deferred in direct mode
			}
			ss.mu.Unlock()
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

// receive turns an AMQP delivery into a message whose context carries its redelivery.Info. For
// a consumer that settles directly, the delivery counts as handed out from here on: the
// consumer may settle it as soon as it has it, before run records the hand-out.
func (ss *session) receive(d amqp.Delivery) *delivery {
	msg, _ := Marshaler{}.Unmarshal(d) // never fails
	ctx, cancel := context.WithCancel(redelivery.NewContext(ss.ctx, deliveryInfo(d, ss.quorum)))
	dv := &delivery{tag: d.DeliveryTag, msg: msg, ctx: ctx, cancel: cancel}
	if ss.direct {
		msg.SetContext(redelivery.NewSettleContext(ctx, func() { ss.settleDirect(dv) }))
	} else {
		msg.SetContext(ctx)
	}
	ss.mu.Lock()
	ss.acked.deliver(d.DeliveryTag)
	if ss.direct {
		ss.inflight[dv.tag] = dv
	}
	ss.mu.Unlock()
	return dv
}

// settleDirect takes the consumer's ack or nack of d, in the consumer's goroutine.
func (ss *session) settleDirect(d *delivery) {
	ack := redelivery.Acked(d.msg)
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.over {
		return // the session is over: an ack now is dropped
	}
	if err := ss.settle(settlement{d: d, ack: ack}); err != nil {
		ss.fail(err)
		return
	}
	if ss.acked.idleDue() {
		select {
		case ss.idle <- struct{}{}:
		default:
		}
	}
}

// fail records the first error of a direct settlement and wakes run, which loses the channel.
// mu is held.
func (ss *session) fail(err error) {
	if ss.err != nil {
		return
	}
	ss.err = err
	select {
	case ss.failed <- struct{}{}:
	default:
	}
}

// handOut records that the consumer has d and, unless the consumer settles directly, waits for
// its ack or nack.
func (ss *session) handOut(d *delivery) {
	now := time.Now()
	ss.mu.Lock()
	if ss.direct {
		if ss.inflight[d.tag] == d {
			d.out = now // not settled already
		}
		ss.mu.Unlock()
		return
	}
	ss.inflight[d.tag] = d
	d.out = now
	ss.mu.Unlock()
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

// settle handles the consumer's ack or nack of a delivery. mu is held.
func (ss *session) settle(st settlement) error {
	d := st.d
	if ss.inflight[d.tag] != d {
		return nil // settled already, by the sweep of end
	}
	delete(ss.inflight, d.tag)
	d.cancel()
	if st.ack {
		now := time.Now()
		var took time.Duration
		if !d.out.IsZero() {
			took = now.Sub(d.out)
		} // else settled directly before run recorded the hand-out: at once
		return ss.send(ss.acked.ack(d.tag, now, took))
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

// nack gives d back to RabbitMQ, to be delivered again. mu is held.
func (ss *session) nack(d *delivery) error {
	if err := ss.acks.Nack(d.tag, false, true); err != nil {
		return fmt.Errorf("nack delivery %d: %w", d.tag, err)
	}
	return ss.send(ss.acked.settle(d.tag))
}

// nackDue sends the held nacks whose delay has passed at now. mu is held.
func (ss *session) nackDue(now time.Time) error {
	for len(ss.held) > 0 && !ss.held[0].due.After(now) {
		if err := ss.nack(heap.Pop(&ss.held).(*delivery)); err != nil {
			return err
		}
	}
	ss.resetNackTimer()
	return nil
}

// resetNackTimer sets the nack timer for the first held nack. mu is held.
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
	log := ss.sub.s.cfg.log
	fields := watermill.LogFields{"queue": ss.sub.queue}
	var errs []error
	if err := ss.ch.Cancel(ss.tag, false); err != nil {
		errs = append(errs, fmt.Errorf("cancel consumer: %w", err))
	}
	ss.mu.Lock()
	for drained := false; !drained; {
		select {
		case st := <-ss.events:
			errs = append(errs, ss.settle(st))
		default:
			drained = true
		}
	}
	// An ack given and not reported yet (or, for a consumer that settles directly, given and
	// not settled yet) is sent all the same.
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
	ss.over = true
	ss.mu.Unlock()
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
	ss.sub.s.cfg.log.Error("Subscription lost its channel; reconnecting", err, watermill.LogFields{"queue": ss.sub.queue})
	ss.mu.Lock()
	ss.over = true
	ss.mu.Unlock()
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
