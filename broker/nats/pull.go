package nats

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// Timings of the pull requests.
const (
	// pullExpires is how long one pull request waits at the server for messages: how often an
	// idle subscription asks for its free window again (a request cannot be enlarged), and
	// how long the request of a client that died stays there (see fetch).
	pullExpires = time.Second
	// probeExpires is how long the probe of a subscription that stops waits (see withdraw).
	probeExpires = 20 * time.Millisecond
	// pullLate is how long after pullExpires a request the server has not ended is taken for
	// dropped, and withdrawn.
	pullLate = 100 * time.Millisecond
	// pullGrace bounds every wait for the server's word on a request (its expiry, the drain
	// of its inbox) before the subscription takes the request, or the connection, for lost.
	pullGrace = 2 * time.Second
)

// errWithdrawn ends a request that the subscription withdraws.
var errWithdrawn = errors.New("pull request withdrawn")

// loseEnd, when set (by tests), reports whether to ignore the server's end of a pull request,
// as if the server had dropped the request without saying so.
var loseEnd func() bool

// errPullLost ends a pull request that the server did not end in time.
var errPullLost = errors.New("the server did not end the pull request in time")

// pullRequest is the body of a request for the messages of a pull consumer
// ($JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>).
type pullRequest struct {
	Batch   int           `json:"batch"`
	Expires time.Duration `json:"expires"`
}

// fetch is one pull request in progress, on an inbox of its own, so that the subscription can
// stop listening to it (jetstream.Consumer.Fetch cannot stop: the request of a subscription
// that stopped would take messages, those it gives back among them, until it expires).
//
// A request that no one listens to is a hazard while it waits at the server: NATS server 2.9,
// at a redelivery while every pull request waiting at a consumer is expired or without a
// listener, rolls the consumer back by one message: the redelivered message comes again with
// its delivery count back at 1, and the one before it a second time, perhaps while a consumer
// holds it (nats-server #5305, fixed in 2.11). The server removes such a request when it
// expires, or passes over it to find a live one; so requests are short (pullExpires), and a
// subscription that stops listening sends a probe behind it (see withdraw).
type fetch struct {
	batch  int
	msgs   chan *nats.Msg // the messages received, at most batch
	done   chan struct{}  // closed when the request has ended
	closed chan struct{}  // closed when the inbox is no longer listened to
	sub    *nats.Subscription

	expiry *time.Timer // fires pullGrace after the server's expiry, in case its word is lost

	mu    sync.Mutex
	got   int
	ended bool
	err   error // why the request ended early; read after done
}

// pull sends a pull request for n messages, that waits up to expires at the server, to the
// consumer's subject and returns it in progress.
func pull(nc *nats.Conn, subject string, n int, expires time.Duration) (*fetch, error) {
	f := &fetch{batch: n, msgs: make(chan *nats.Msg, n), done: make(chan struct{}), closed: make(chan struct{})}
	inbox := nc.NewInbox()
	var err error
	if f.sub, err = nc.Subscribe(inbox, f.receive); err != nil {
		return nil, err
	}
	f.sub.SetClosedHandler(func(string) { close(f.closed) })
	f.expiry = time.AfterFunc(expires+pullGrace, func() { f.finish(errPullLost) })
	body, _ := json.Marshal(pullRequest{Batch: n, Expires: expires})
	if err := nc.PublishRequest(subject, inbox, body); err != nil {
		f.finish(err)
		return nil, err
	}
	return f, nil
}

// receive takes one message of the request's inbox: a message of the stream, or a status of
// the request (expiry, error). Messages are taken until no one listens, also after the
// request ended: a withdrawn request may still bring some (see drain).
func (f *fetch) receive(m *nats.Msg) {
	if status := m.Header.Get("Status"); status != "" && len(m.Data) == 0 {
		switch status {
		case "100": // a heartbeat: none is asked for
		case "404", "408": // no messages, request expired
			if loseEnd != nil && loseEnd() {
				return // as if the server had not said it
			}
			f.finish(nil)
		default: // 409: consumer deleted, too many waiting requests, ...
			f.finish(fmt.Errorf("pull request refused: %s %s", status, m.Header.Get("Description")))
		}
		return
	}
	f.mu.Lock()
	if f.got == f.batch {
		f.mu.Unlock()
		return // the server sends no more than the batch
	}
	f.got++
	f.msgs <- m // never blocks: at most batch messages
	full := f.got == f.batch
	f.mu.Unlock()
	if full {
		f.finish(nil)
	}
}

// each passes each message the request has received, and nobody has taken, to fn.
func (f *fetch) each(fn func(*nats.Msg)) {
	for {
		select {
		case m := <-f.msgs:
			fn(m)
		default:
			return
		}
	}
}

// end marks the request ended, with err when it failed, and reports whether it was not ended
// already.
func (f *fetch) end(err error) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ended {
		return false
	}
	f.ended = true
	f.err = err
	f.expiry.Stop()
	close(f.done)
	return true
}

// finish ends the request and stops listening on its inbox: for a request that the server has
// ended (filled, expired, refused) or that is lost.
func (f *fetch) finish(err error) {
	if f.end(err) {
		_ = f.sub.Unsubscribe()
	}
}

// drain ends a request that may still be waiting at the server, and stops listening once the
// server has taken note: the messages it sent to the request before, which arrive before its
// answer, are still taken (the nats.go drain of a subscription). It reports false when the
// request had ended already, or the drain could not start.
func (f *fetch) drain(cause error) bool {
	if !f.end(cause) {
		return false
	}
	if err := f.sub.Drain(); err != nil {
		_ = f.sub.Unsubscribe()
		return false
	}
	return true
}
