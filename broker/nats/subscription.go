package nats

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats.go"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// fillWait is how long free room in the window waits to grow to half the window before it is
// asked for anyway: a busy subscription fetches in batches, a slow one is not starved.
const fillWait = 5 * time.Millisecond

// Timings of the fetch loop.
const (
	// retryMin and retryMax bound the pause after a failed pull request; it doubles with
	// every failure in a row.
	retryMin = 50 * time.Millisecond
	retryMax = 5 * time.Second
)

// subscription is the JetStream side of one Subscribe call (an inflight.Source): it asks the
// group's consumer for as many messages as the engine's window has free room, and settles
// each delivery with the frame JetStream takes on its reply subject.
type subscription struct {
	s       *Subscriber
	topic   string
	stream  string
	subject string        // the consumer's pull subject
	ackWait time.Duration // the consumer's AckWait, as the subscription last saw it
	logger  watermill.LoggerAdapter
	sub     *inflight.Subscription[reply]

	// State of Fetch alone: the pause after a failure, and the timer of a request that the
	// server has not ended in time (see deliver), made once.
	pause time.Duration
	late  *time.Timer
}

// reply is what a delivery keeps of its JetStream message: the message, whose reply subject
// settles it, and the connection it came on.
type reply struct {
	jm   *nats.Msg
	link *link
}

// pullSubject is the subject of the pull requests of a consumer.
func pullSubject(stream, consumer string) string {
	return "$JS.API.CONSUMER.MSG.NEXT." + stream + "." + consumer
}

// Fetch asks the consumer for n messages, once connected, and hands them out as they come
// until the request ends. After a failed request it pauses (see recover).
func (sub *subscription) Fetch(ctx context.Context, n int) error {
	link := sub.s.currentLink()
	select {
	case <-link.up:
	case <-ctx.Done():
		return nil
	}
	if link.isLost() {
		// The connection was lost meanwhile: a request sent now would wait in the client's
		// reconnect buffer, and reach the server with its inbox already dropped. Ask on the
		// next connection.
		return nil
	}
	f, err := pull(sub.s.nc, sub.subject, n, pullExpires)
	if err != nil {
		if errors.Is(err, nats.ErrConnectionClosed) {
			if ctx.Err() == nil {
				sub.logger.Error("NATS connection closed: the subscription ends", err, nil)
				return err
			}
			return nil
		}
		sub.recover(ctx, err)
		return nil
	}
	sub.deliver(ctx, f, link)
	if f.err != nil && !errors.Is(f.err, errWithdrawn) {
		sub.recover(ctx, f.err)
		return nil
	}
	sub.pause = 0
	return nil
}

// deliver hands out the messages of f as they come, until the request ends, its connection is
// lost, or the subscription ends. A request that the server has not ended pullLate after its
// expiry is taken for dropped (NATS server 2.9 drops a request that expires at the moment a
// message comes, without a word, nats-server #3942): it is withdrawn, so that the next one
// goes at once instead of after pullGrace.
func (sub *subscription) deliver(ctx context.Context, f *fetch, link *link) {
	if sub.late == nil {
		sub.late = time.NewTimer(pullExpires + pullLate)
	} else {
		sub.late.Reset(pullExpires + pullLate)
	}
	defer sub.late.Stop()
	for {
		select {
		case m := <-f.msgs:
			sub.handOut(m, link)
		case <-f.done:
			f.each(func(m *nats.Msg) { sub.handOut(m, link) })
			return
		case <-link.lost:
			// What the request brought and what it still would came on, or were asked for
			// on, the lost connection: leave them to AckWait, like the deliveries in
			// flight, and ask anew once connected again.
			f.finish(ErrConnectionLost)
			return
		case <-ctx.Done():
			sub.withdraw(f, link, false)
			return
		case <-sub.late.C:
			sub.logger.Debug("Pull request not ended by the server after its expiry; withdrawn", nil)
			sub.withdraw(f, link, true)
			return
		}
	}
}

// withdraw ends a request that may still be waiting at the server, leaving the server no
// moment when the request lies there without a listener (see fetch): a probe, a request for
// one message that expires at once, goes first, to wait behind it; then the request is
// drained (the subscription stops listening once the server has taken note). The server
// passes over the dropped request to reach the probe, or removes both when the probe expires.
// What the requests brought is handed out (keep), or, for a subscription that ends, given
// back once the probe has ended too.
func (sub *subscription) withdraw(f *fetch, link *link, keep bool) {
	var held []*nats.Msg
	take := func(f *fetch) {
		f.each(func(m *nats.Msg) {
			if keep {
				sub.handOut(m, link)
			} else {
				held = append(held, m)
			}
		})
	}
	defer func() {
		for _, m := range held {
			_ = m.Nak()
		}
	}()
	// wait waits for ch, and reports false when the connection was lost first: what the
	// requests brought is then left to AckWait, like the deliveries in flight.
	wait := func(ch <-chan struct{}) bool {
		timeout := time.NewTimer(pullGrace)
		defer timeout.Stop()
		select {
		case <-ch:
			return true
		case <-timeout.C:
			return true // what comes later is left to AckWait
		case <-link.lost:
			held = nil
			return false
		}
	}

	select {
	case <-f.done: // the server has ended it: nothing is left there
		take(f)
		return
	default:
	}
	probe, _ := pull(sub.s.nc, sub.subject, 1, probeExpires) // nil when it could not go
	if f.drain(errWithdrawn) {
		if !wait(f.closed) {
			return
		}
	}
	take(f)
	if probe != nil {
		if !wait(probe.done) {
			probe.finish(ErrConnectionLost)
			return
		}
		take(probe)
	}
}

// handOut makes m a delivery, which the engine hands out. A message the subscription no
// longer takes (it is ending) is given back; one that came on a connection since lost is left
// to AckWait.
func (sub *subscription) handOut(m *nats.Msg, link *link) {
	count, ok := numDelivered(m.Reply)
	if !ok {
		// Not a JetStream delivery: it cannot be acknowledged.
		err := fmt.Errorf("reply subject %q is not a JetStream ack subject", m.Reply)
		sub.logger.Error("Dropping a message without JetStream metadata", err, watermill.LogFields{"subject": m.Subject})
		return
	}
	d := sub.sub.Emit(inflight.Item[reply]{
		Data:     reply{jm: m, link: link},
		Msg:      Unmarshal(m),
		Count:    count,
		Deadline: time.Now().Add(sub.ackWait), // JetStream's AckWait runs from the delivery, a little earlier
	})
	if d == nil {
		_ = m.Nak()
		return
	}
	if link.isLost() { // lost as it came: its deliveries may have ended before this one joined
		sub.sub.End(ErrConnectionLost, func(x *inflight.Delivery[reply]) bool { return x == d })
	}
}

// watchLinks ends the deliveries of each connection that is lost, until the subscription
// ends.
func (sub *subscription) watchLinks() {
	for {
		l := sub.s.currentLink()
		select {
		case <-l.lost:
			sub.sub.End(ErrConnectionLost, func(d *inflight.Delivery[reply]) bool { return d.Data.link == l })
		case <-sub.sub.Stopping():
			return
		}
	}
}

// Settle tells the server how a delivery ended: the ack or nack the consumer gave, or a nak
// that gives back the message of a subscription that ended. A delivery whose AckWait passed or
// whose connection was lost is left to the server (a nack then might make it deliver the
// message twice at once); an ack given before is still sent: it can only spare a redelivery.
func (sub *subscription) Settle(d *inflight.Delivery[reply], o inflight.Outcome) {
	switch {
	case o.Acked:
		sub.report(d, "ack", sub.s.nc.Publish(d.Data.jm.Reply, ackBody))
	case o.Cause == nil || (ends(o.Cause) && !d.Data.link.isLost()):
		if o.Nacked {
			sub.report(d, "nak", d.Data.jm.NakWithDelay(o.Delay))
		} else {
			sub.report(d, "give back", d.Data.jm.Nak())
		}
	}
}

// ends reports whether cause ends the subscription, rather than the delivery alone.
func ends(cause error) bool {
	return !errors.Is(cause, ErrAckWaitPassed) && !errors.Is(cause, ErrConnectionLost)
}

// Close has nothing of its own to release: the Subscriber's Close makes sure the server has
// the acknowledgements.
func (*subscription) Close(context.Context) error { return nil }

// ackBody is the body of an acknowledgement, on the delivery's reply subject. (nats.Msg.Ack
// costs an allocation and a lock per ack for options and checks that the subscriber does not
// need: it acks each delivery once, with a Publish of ackBody.)
var ackBody = []byte("+ACK")

// report logs a failure to settle: the server delivers the message again after AckWait.
func (sub *subscription) report(d *inflight.Delivery[reply], what string, err error) {
	if err != nil {
		sub.logger.Error("Could not "+what+" a delivery: JetStream delivers it again after AckWait", err, watermill.LogFields{
			"message_uuid": d.Msg.UUID,
		})
	}
}

// recover reacts to a failed pull request: after a pause that grows with the failures in a
// row, and once the consumer is there again (someone may have deleted it), the loop goes on.
func (sub *subscription) recover(ctx context.Context, err error) {
	if errors.Is(err, errPullLost) || errors.Is(err, ErrConnectionLost) {
		// The connection is down or was: the subscription waits for it.
		sub.logger.Debug("Pull request lost", watermill.LogFields{"error": err})
		return
	}
	sub.pause = min(max(2*sub.pause, retryMin), retryMax)
	sub.logger.Error("Pull request failed", err, watermill.LogFields{"retry_in": sub.pause})
	if !sub.sub.Sleep(sub.pause) {
		return
	}
	cons, err := sub.s.ensureConsumer(ctx, sub.stream, sub.topic)
	if err != nil {
		if ctx.Err() == nil {
			sub.logger.Error("JetStream consumer not available", err, nil)
		}
		return
	}
	sub.ackWait = cons.CachedInfo().Config.AckWait
}
