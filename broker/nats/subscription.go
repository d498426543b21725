package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
)

// fillWait is how long free room in the window waits to grow to half the window before it is
// asked for anyway, so that a busy subscription fetches in batches without starving a slow
// one. A variable for the tests only.
var fillWait = 5 * time.Millisecond

// Timings of the fetch loop.
const (
	// retryMin and retryMax bound the pause after a failed pull request; it doubles with
	// every failure in a row.
	retryMin = 50 * time.Millisecond
	retryMax = 5 * time.Second
)

// subscription is one Subscribe call: a loop that asks the group's consumer for as many
// messages as its window has free room, and hands each one out.
type subscription struct {
	s       *Subscriber
	topic   string
	stream  string
	subject string        // the consumer's pull subject
	ackWait time.Duration // the consumer's AckWait, as the subscription last saw it
	logger  watermill.LoggerAdapter

	// ctx ends when the Subscribe context ends or the Subscriber closes; the deliveries'
	// contexts derive from it.
	ctx                context.Context
	cancel             context.CancelCauseFunc
	stopWithSubscriber func() bool
	// withdrawn is closed once the subscription has ended and its pull request is withdrawn:
	// a message given back before would go straight back to that request.
	withdrawn chan struct{}

	out chan *message.Message
	win *window
	// hurry is win.hurry, the function each delivery's redelivery.Flush runs: made once, as a
	// method value allocates each time it is taken.
	hurry func()
	// hand holds the deliveries when the consumer settles each message itself
	// (redelivery.SettlesDirectly); nil when each delivery has a watcher.
	hand *hand
}

// pullSubject is the subject of the pull requests of a consumer.
func pullSubject(stream, consumer string) string {
	return "$JS.API.CONSUMER.MSG.NEXT." + stream + "." + consumer
}

// run fetches and hands out messages until the subscription's context ends, then closes the
// channel.
func (sub *subscription) run() {
	defer sub.s.pullers.Done()
	if sub.hand != nil {
		defer sub.hand.giveBack()
	}
	defer close(sub.withdrawn)
	defer close(sub.out)
	defer sub.stopWithSubscriber()
	defer sub.cancel(nil)

	pause := time.Duration(0) // after a failure
	eager := true             // the last request came back short: ask for the room there is at once
	for {
		link := sub.s.currentLink()
		select {
		case <-link.up:
		case <-sub.ctx.Done():
			return
		}
		n := sub.win.take(sub.ctx, eager)
		if n == 0 {
			return
		}
		select {
		case <-link.lost:
			// The places came back as the connection was lost (its deliveries ended): a
			// request sent now would wait in the client's reconnect buffer, and reach the
			// server with its inbox already dropped. Ask on the next connection.
			sub.win.give(n)
			continue
		default:
		}
		f, err := pull(sub.s.nc, sub.subject, n, pullExpires)
		if err != nil {
			sub.win.give(n)
			if errors.Is(err, nats.ErrConnectionClosed) {
				if sub.ctx.Err() == nil {
					sub.logger.Error("NATS connection closed: the subscription ends", err, nil)
				}
				return
			}
			if !sub.recover(err, &pause) {
				return
			}
			continue
		}
		got, ok := sub.deliver(f, link)
		sub.win.give(n - got)
		if !ok {
			return
		}
		if f.err != nil {
			if !sub.recover(f.err, &pause) {
				return
			}
			eager = true
			continue
		}
		pause = 0
		eager = got < n
	}
}

// deliver hands out the messages of f as they come, and returns how many deliveries it made
// of them, and false when the subscription ended.
func (sub *subscription) deliver(f *fetch, link *link) (got int, ok bool) {
	for {
		select {
		case m := <-f.msgs:
			if sub.handOut(m, link) {
				got++
			}
		case <-f.done:
			for {
				select {
				case m := <-f.msgs:
					if sub.handOut(m, link) {
						got++
					}
				default:
					return got, true
				}
			}
		case <-link.lost:
			// What the request brought and what it still would came on, or were asked for
			// on, the lost connection: leave them to AckWait, like the deliveries in
			// flight, and ask anew once connected again.
			f.finish(ErrConnectionLost)
			return got, true
		case <-sub.ctx.Done():
			sub.withdraw(f, link)
			return got, false
		}
	}
}

// withdraw ends the request of a subscription that ended, and gives back what it brought,
// in a way that leaves the server no moment when it could redeliver a message while the
// request lies there without a listener (see fetch). A probe, a request for one message that
// expires at once, goes to the server first, to wait behind the request. Then the request is
// drained: the subscription stops listening once the server has taken note, and takes what the
// request brought up to then. The server passes over the dropped request to reach the probe,
// or removes both when the probe expires. Once the probe has ended too, the messages are
// given back, and the subscription's deliveries too (sub.withdrawn).
func (sub *subscription) withdraw(f *fetch, link *link) {
	var held []*nats.Msg
	take := func(f *fetch) {
		for {
			select {
			case m := <-f.msgs:
				held = append(held, m)
			default:
				return
			}
		}
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
	probe, err := pull(sub.s.nc, sub.subject, 1, probeExpires)
	if err != nil {
		probe = nil
	}
	if f.drain(context.Cause(sub.ctx)) {
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

// handOut makes m a delivery and hands it to the consumer, unless the delivery ends first. It
// reports whether m became a delivery, which holds its place of the window until it ends.
func (sub *subscription) handOut(m *nats.Msg, link *link) bool {
	count, ok := numDelivered(m.Reply)
	if !ok {
		// Not a JetStream delivery: it cannot be acknowledged.
		err := fmt.Errorf("reply subject %q is not a JetStream ack subject", m.Reply)
		sub.logger.Error("Dropping a message without JetStream metadata", err, watermill.LogFields{"subject": m.Subject})
		return false
	}
	d := sub.newDelivery(m, count, link)
	if sub.hand != nil {
		sub.hand.handOut(d)
		return true
	}
	select {
	case sub.out <- d.msg:
	case <-d.ctx.Done():
		// Its AckWait passed, its connection was lost or the subscription ended before the
		// consumer took it: the delivery's watcher has dealt with it.
	}
	return true
}

// recover reacts to a failed pull request: after a pause that grows with the failures in a
// row, and once the consumer is there again (someone may have deleted it), the loop goes on.
// It reports false when the subscription ended meanwhile.
func (sub *subscription) recover(err error, pause *time.Duration) bool {
	if errors.Is(err, errPullLost) || errors.Is(err, ErrConnectionLost) {
		// The connection is down or was: the subscription waits for it.
		sub.logger.Debug("Pull request lost", watermill.LogFields{"error": err})
		return sub.ctx.Err() == nil
	}
	*pause = min(max(2**pause, retryMin), retryMax)
	sub.logger.Error("Pull request failed", err, watermill.LogFields{"retry_in": *pause})
	t := time.NewTimer(*pause)
	defer t.Stop()
	select {
	case <-t.C:
	case <-sub.ctx.Done():
		return false
	}
	cons, err := sub.s.ensureConsumer(sub.ctx, sub.stream, sub.topic)
	if err != nil {
		if sub.ctx.Err() != nil {
			return false
		}
		sub.logger.Error("JetStream consumer not available", err, nil)
		return true
	}
	sub.ackWait = cons.CachedInfo().Config.AckWait
	return true
}

// window counts the places of a subscription's window that are taken: by a delivery that is
// not settled or ended yet, or by a pull request for the messages it may still bring.
type window struct {
	size  int
	freed chan struct{} // signalled (not counted) when places are given back

	mu   sync.Mutex
	used int
	// hurried: the consumer settled a batch together and waits for more before it settles
	// others (redelivery.Flush), so the next take asks for the free places at once.
	hurried bool
}

func newWindow(size int) *window {
	return &window{size: size, freed: make(chan struct{}, 1)}
}

// give gives n places back.
func (w *window) give(n int) {
	if n == 0 {
		return
	}
	w.mu.Lock()
	w.used -= n
	w.mu.Unlock()
	select {
	case w.freed <- struct{}{}:
	default:
	}
}

// hurry tells the window that the consumer has settled a batch together and settles no more
// until new messages come (redelivery.Flush: a group that committed in one transaction): the
// places free then are asked for at once, without waiting for half the window. A consumer
// that holds more than half the window in one group would otherwise wait fillWait for each
// refill, with its next group short.
func (w *window) hurry() {
	w.mu.Lock()
	w.hurried = true
	w.mu.Unlock()
	select {
	case w.freed <- struct{}{}:
	default:
	}
}

// take waits for free places and takes them all: once half the window is free; or once some
// is free and either eager is set (the consumer had no more messages at once, and a new one
// must not wait), the consumer hurried it, or fillWait has passed. It returns 0 when ctx ends.
func (w *window) take(ctx context.Context, eager bool) int {
	var waited <-chan time.Time
	filled := false
	for {
		w.mu.Lock()
		free := w.size - w.used
		if free > 0 && (2*free >= w.size || eager || filled || w.hurried) {
			w.used = w.size
			w.hurried = false
			w.mu.Unlock()
			return free
		}
		w.mu.Unlock()
		if free > 0 && waited == nil {
			t := time.NewTimer(fillWait)
			defer t.Stop()
			waited = t.C
		}
		select {
		case <-w.freed:
		case <-waited:
			filled = true
		case <-ctx.Done():
			return 0
		}
	}
}
