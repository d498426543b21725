package nats

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// delivery is one message handed out, from its receipt until it is settled or ends. Only one
// party sends the message's ack or nack, once: the delivery's watcher, or, for a consumer that
// settles each message itself, the subscription's hand.
type delivery struct {
	sub    *subscription
	jm     *nats.Msg
	msg    *message.Message
	ctx    context.Context
	cancel context.CancelCauseFunc
	link   *link

	// Under sub.hand.mu, for a consumer that settles each message itself: the delivery is in
	// the hand (held), between prev and next, until it leaves it; and it ends unsettled at
	// deadline.
	held       bool
	prev, next *delivery
	deadline   time.Time
}

// newDelivery makes the watermill message of jm, the count-th delivery of its message, and
// keeps track of the delivery: in the subscription's hand when the consumer settles each
// message itself, else with a watcher of its own. The delivery takes one place of the window
// until it ends.
func (sub *subscription) newDelivery(jm *nats.Msg, count int, link *link) *delivery {
	msg := Unmarshal(jm)
	d := &delivery{sub: sub, jm: jm, msg: msg, link: link}
	info := redelivery.Info{Count: count, DelaysNacks: true}
	sub.s.deliveries.Add(1)
	if sub.hand == nil {
		d.ctx, d.cancel = context.WithCancelCause(sub.ctx)
		msg.SetContext(redelivery.NewContext(d.ctx, info))
		go d.watch(sub.ackWait)
		return d
	}
	d.ctx, d.cancel = context.WithCancelCause(sub.hand.base)
	msg.SetContext(redelivery.NewDeliveryContext(d.ctx, info, d.settled, sub.hurry))
	sub.hand.add(d, sub.ackWait)
	return d
}

// settled is the delivery's function for redelivery.Settle.
func (d *delivery) settled() { d.sub.hand.settled(d) }

// release gives the delivery's place of the window back, once it has ended.
func (d *delivery) release() {
	d.sub.win.give(1)
	d.sub.s.deliveries.Done()
}

// watch waits for the delivery to be settled or to end, and tells the server what it must
// know: the ack or nack given before the end, or, when the subscription ended first, a nak
// that gives the message back. A delivery whose AckWait passed or whose connection was lost is
// left to the server, which delivers it again: a nack sent then might make it deliver the
// message a second time while another consumer holds it. The context is cancelled in every
// case.
func (d *delivery) watch(ackWait time.Duration) {
	defer d.release()
	// JetStream's AckWait runs from the delivery, which is a little earlier than this.
	deadline := time.NewTimer(ackWait)
	defer deadline.Stop()
	select {
	case <-d.msg.Acked():
		d.ack()
	case <-d.msg.Nacked():
		d.nak()
	case <-deadline.C:
		d.end(ErrAckWaitPassed)
	case <-d.link.lost:
		d.end(ErrConnectionLost)
	case <-d.ctx.Done():
		// The subscription ended: give the message back, unless the consumer settled it
		// just before; once the subscription's pull request is withdrawn, or the message
		// would go straight back to it.
		<-d.sub.withdrawn
		if !d.settle() {
			d.report("give back", d.jm.Nak())
		}
	}
	d.cancel(nil)
}

// end ends the delivery with cause. An ack given at the same moment is still sent: the server
// takes it by stream sequence, and it can only spare a redelivery.
func (d *delivery) end(cause error) {
	d.cancel(cause)
	select {
	case <-d.msg.Acked():
		d.ack()
	default:
	}
}

// settle sends the ack or the nack that the consumer gave, and reports false when it gave
// neither.
func (d *delivery) settle() bool {
	select {
	case <-d.msg.Acked():
		d.ack()
	case <-d.msg.Nacked():
		d.nak()
	default:
		return false
	}
	return true
}

// ackBody is the body of an acknowledgement, on the delivery's reply subject.
var ackBody = []byte("+ACK")

// ack acknowledges the message, asynchronously: nats.go writes it out with the acks given
// around it, in one flush. (nats.Msg.Ack costs an allocation and a lock per ack for options
// and checks that the subscriber does not need: it acks each delivery once.)
func (d *delivery) ack() { d.report("ack", d.sub.s.nc.Publish(d.jm.Reply, ackBody)) }

// nak asks the server to deliver the message again after the delay that the nack requested,
// or Config.NackDelay.
func (d *delivery) nak() {
	delay, ok := redelivery.RequestedDelay(d.msg.Context())
	if !ok {
		delay = d.sub.s.cfg.NackDelay
	}
	if delay > 0 {
		d.report("nak", d.jm.NakWithDelay(delay))
		return
	}
	d.report("nak", d.jm.Nak())
}

// report logs a failure to settle: the server delivers the message again after AckWait.
func (d *delivery) report(what string, err error) {
	if err != nil {
		d.sub.logger.Error("Could not "+what+" a delivery: JetStream delivers it again after AckWait", err, watermill.LogFields{
			"message_uuid": d.msg.UUID,
		})
	}
}
