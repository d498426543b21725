package nats

import (
	"context"
	"math"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// delivery is one message handed out, from its receipt until it is settled or ends. Its
// watcher is the only one to send the message's ack or nack, once.
type delivery struct {
	sub    *subscription
	jm     *nats.Msg
	msg    *message.Message
	ctx    context.Context
	cancel context.CancelCauseFunc
	link   *link
}

// newDelivery makes the watermill message of jm and starts the watcher of its delivery: the
// delivery takes one place of the window until it ends.
func (sub *subscription) newDelivery(jm *nats.Msg, meta *nats.MsgMetadata, link *link) *delivery {
	msg := Unmarshal(jm)
	ctx, cancel := context.WithCancelCause(sub.ctx)
	count := int(min(meta.NumDelivered, math.MaxInt32))
	msg.SetContext(redelivery.NewContext(ctx, redelivery.Info{Count: count, DelaysNacks: true}))
	d := &delivery{sub: sub, jm: jm, msg: msg, ctx: ctx, cancel: cancel, link: link}
	sub.s.deliveries.Add(1)
	go d.watch(sub.ackWait)
	return d
}

// watch waits for the delivery to be settled or to end, and tells the server what it must
// know: the ack or nack given before the end, or, when the subscription ended first, a nak
// that gives the message back. A delivery whose AckWait passed or whose connection was lost is
// left to the server, which delivers it again: a nack sent then might make it deliver the
// message a second time while another consumer holds it. The context is cancelled in every
// case.
func (d *delivery) watch(ackWait time.Duration) {
	defer d.sub.s.deliveries.Done()
	defer d.sub.win.give(1)
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
		select {
		case <-d.msg.Acked():
			d.ack()
		case <-d.msg.Nacked():
			d.nak()
		default:
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

// ack acknowledges the message, asynchronously.
func (d *delivery) ack() { d.report("ack", d.jm.Ack()) }

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
