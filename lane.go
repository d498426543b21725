package onceflow

import (
	"context"
	"runtime/debug"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/crashpoint"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/groupcommit"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file holds the lane: how a handler with group commit runs a first delivery without a
// goroutine of its own.
//
// Under group commit, a delivery's goroutine spends its life waiting: for its group to form,
// run and commit. The lane does the waiting without it. The subscription's reader begins the
// chain's observers (tracing, metrics) and joins the delivery to its subscription's group
// directly (groupcommit.Joiner); the group's goroutine, once the outcome of its transaction is
// known, ends the observers and acks the delivery. The interceptors between the observers and
// group commit (dead-letter, recover, retry, timeout) leave a first delivery that commits, or
// is a duplicate, alone, so nothing of theirs is skipped. Any other result (an error, a panic,
// a group that rolled back) sends the delivery through those interceptors after all, in a
// goroutine, with that result as its first attempt's (groupcommit.AfterJoin): they retry,
// dead-letter or give up exactly as they would have.
//
// Only first deliveries take the lane. A redelivery may be one that killed its consumer, which
// the router watches (isolate): it goes the usual way.

// lane is the lane of one handler.
type lane struct {
	// observers are the chain's outermost interceptors, which only observe.
	observers []middleware.Observer
	// timeout is the handler's timeout of an attempt; 0 for none.
	timeout time.Duration
	// firstAttempt: the chain retries, and numbers the attempts from 1 (MessageData.Attempt).
	firstAttempt bool
	// bySubscription: each subscription's deliveries form groups of their own, one running at
	// a time (the default); without, a group collects every subscription's for up to the
	// handler's GroupCommit.MaxWait.
	bySubscription bool
	// joiner is the group interceptor, with the rest of the chain inside it.
	joiner groupcommit.Joiner
	// rest is the chain without its observers, for a delivery whose result asks for it.
	rest processor.Processor
}

// newLane returns the lane of a handler h whose chain is links around inner, or nil when its
// chain does not allow one: it must start with observers (built-in or UseObserver), go on with
// stages that leave a first delivery that succeeds alone, and then hand the message to its
// group transaction.
func newLane(h Handler, links []link, inner processor.Processor) *lane {
	if h.qos() == BestEffort {
		return nil
	}
	l := &lane{bySubscription: h.GroupCommit.MaxWait == 0}
	observing := true
	for i, lk := range links {
		switch lk.lane {
		case laneObserve:
			if !observing || lk.observer == nil {
				return nil // an observer inside a stage that acts: it must see every attempt
			}
			l.observers = append(l.observers, lk.observer)
			continue
		case lanePass:
			observing = false
			l.firstAttempt = l.firstAttempt || lk.name == StageRetry
			if lk.name == StageTimeout {
				l.timeout = h.Timeout
			}
			continue
		case laneJoin:
			joiner, ok := compose(links[i:], inner).(groupcommit.Joiner)
			if !ok {
				return nil
			}
			l.joiner = joiner
			l.rest = compose(links[len(l.observers):], inner)
			return l
		}
		return nil // a middleware of one's own may do anything
	}
	return nil
}

// laneDelivery is one delivery in the lane, made with its context (delivery.StartWith). It
// receives the result of its first attempt (groupcommit.Joined).
type laneDelivery struct {
	c   *consumer
	l   *lane
	msg *message.Message
	md  *messagedata.MessageData
	st  *delivery.State
	// ctx is the delivery's context; begun are the contexts the observers' Begin returned, in
	// begunIn when there are few.
	ctx     context.Context
	begun   []context.Context
	begunIn [2]context.Context
	// cancel ends the attempt's timeout; nil without one.
	cancel context.CancelFunc
	// shared: the delivery holds the handler's isolation lock, shared.
	shared bool
	// slot is the delivery's place in its group.
	slot groupcommit.Slot
}

// take runs msg, which has entered the gate and holds a slot, through the lane when it is a
// first delivery whose message converts, and reports whether it did; the caller starts any
// other delivery the usual way. sub is the subscription that delivered msg: unless the handler
// has a GroupCommit.MaxWait, its deliveries form groups of their own, one running at a time
// (groupcommit.Joiner).
func (l *lane) take(c *consumer, msg *message.Message, sub int) bool {
	info, known := redelivery.FromContext(msg.Context())
	if known && !info.First() || !known && c.counter != nil {
		return false // a redelivery, or one only the durable counter can tell
	}
	md, err := c.conv.FromMessage(c.topic, msg)
	if err != nil {
		return false
	}
	crashpoint.Reach(crashpoint.Received, md.ID)
	ctx, st, d := delivery.StartWith[laneDelivery](msg.Context(), c.name, time.Now())
	st.Records = c.records
	st.GivesBackOutages = c.outage != nil
	md.Delivery, _ = c.deliveries(ctx, msg, md) // a first delivery: its count needs no counter
	if l.firstAttempt {
		md.Attempt = 1
	}
	d.c, d.l, d.msg, d.md, d.st, d.ctx = c, l, msg, md, st, ctx
	if n := len(l.observers); n <= len(d.begunIn) {
		d.begun = d.begunIn[:n]
	} else {
		d.begun = make([]context.Context, n)
	}
	if c.counter != nil && !c.shared {
		c.isolation.RLock() // as isolate takes it for a first delivery
		d.shared = true
	}
	for i, o := range l.observers {
		ctx = o.Begin(ctx, md)
		d.begun[i] = ctx
	}
	if l.timeout > 0 {
		ctx, d.cancel = context.WithTimeout(ctx, l.timeout)
	}
	group := 0 // shared by the subscriptions
	if l.bySubscription {
		group = sub + 1
	}
	l.joiner.Join(ctx, md, group, &d.slot, d)
	return true
}

// Joined receives the result of the delivery's first attempt, in the goroutine of the group
// that ran it: a commit or a duplicate ends the delivery here, anything else sends it through
// the rest of the chain.
func (d *laneDelivery) Joined(err error) {
	if d.cancel != nil {
		d.cancel()
		d.cancel = nil
	}
	switch processor.OutcomeOf(err) {
	case processor.Processed, processor.Duplicate:
		d.end(err)
	default:
		go d.resume(err)
	}
}

// resume runs the delivery through the chain without its observers, with err as its first
// attempt's result, and ends it.
func (d *laneDelivery) resume(err error) { d.end(d.runRest(err)) }

// runRest runs the chain without its observers, with err as the first attempt's result, and
// returns its result: a panic that no interceptor recovers (a chain without Recover) as a
// *processor.PanicError, which fails the delivery.
func (d *laneDelivery) runRest(err error) (result error) {
	ctx := d.ctx
	if n := len(d.begun); n > 0 {
		ctx = d.begun[n-1]
	}
	defer func() {
		if v := recover(); v != nil {
			result = &processor.PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	groupcommit.AfterJoin(ctx, err)
	return d.l.rest.Process(ctx, d.md)
}

// end ends the observers of the delivery whose chain returned err, and acks or nacks it.
func (d *laneDelivery) end(err error) {
	c := d.c
	if d.shared {
		c.isolation.RUnlock()
	}
	for i, o := range slices.Backward(d.l.observers) {
		o.End(d.begun[i], d.md, err)
	}
	<-c.slots // the next delivery may start while this one is settled
	c.finish(d.ctx, d.msg, d.md, d.st, err)
	c.router.gate.leave()
}
