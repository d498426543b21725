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
	// flush is flushDirect, bound once: a method value per delivery would be an allocation.
	flush func()
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
	ss.flush = ss.flushDirect
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
	dv := &delivery{tag: d.DeliveryTag, msg: msg}
	info := deliveryInfo(d, ss.quorum)
	if ss.direct {
		var base context.Context
		base, dv.cancel = context.WithCancel(ss.ctx)
		dv.ctx = redelivery.NewDeliveryContext(base, info, func() { ss.settleDirect(dv) }, ss.flush)
	} else {
		dv.ctx, dv.cancel = context.WithCancel(redelivery.NewContext(ss.ctx, info))
	}
	msg.SetContext(dv.ctx)
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

// flushDirect sends the acks at the front of the window now, in the goroutine of a consumer
// that settles directly and has settled a batch together (redelivery.Flush): their deliveries
// leave RabbitMQ's prefetch window at once, instead of after AckDelay, for the next ones.
func (ss *session) flushDirect() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.over {
		return
	}
	if err := ss.send(ss.acked.flushPrefix()); err != nil {
		ss.fail(err)
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
