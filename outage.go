package onceflow

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/sqldb"
)

// This file holds a handler's pause during an outage: a failure that is not its messages'
// (sqldb.IsOutage: the database unreachable or read-only, the dead-letter broker refusing every
// message). A delivery that fails so is given back to the broker unprocessed and not counted
// against its message's delivery limit; the handler stops taking deliveries, waits, probes the
// database, lets one delivery through as a trial, and runs again once a delivery gets an
// outcome that is the message's own. One log line says when it pauses, one when it resumes.

// Outage timings: the first wait before a probe, doubling up to the longest, so that a
// handler takes up its work again within outageMaxBackoff (plus a probe) of the end of an
// outage. outageProbeTimeout bounds one probe.
const (
	outageMinBackoff   = 100 * time.Millisecond
	outageMaxBackoff   = 2 * time.Second
	outageProbeTimeout = 2 * time.Second
	// outageMaxUncounted bounds the ids whose given-back deliveries a handler remembers: an
	// outage that gives back more distinct messages than that counts the deliveries of the
	// others (the broker's count, or the durable one) as usual.
	outageMaxUncounted = 100_000
)

// The states of an outage.
const (
	outageNone   int32 = iota // running
	outagePaused              // paused: no delivery is taken; probing
	outageTrial               // the probe passed: one delivery is let through to tell
)

// outage is one handler's pause.
type outage struct {
	c *consumer
	// probe asks the handler's database whether it answers; nil for a handler without one.
	probe func(ctx context.Context) error
	// state is read without the lock on every delivery; written under it.
	state atomic.Int32
	// uncounted is how many entries given holds, read without the lock on every ack.
	uncounted atomic.Int32

	mu sync.Mutex
	// wake is closed when the state leaves outagePaused (and when a trial is abandoned), then
	// replaced: the readers waiting for a state they may read in wake up.
	wake chan struct{}
	// trialTaken: a reader has taken the trial delivery.
	trialTaken bool
	since      time.Time
	reason     string
	// given counts, by message id (counterID), the deliveries given back during outages:
	// the delivery limit does not count them.
	given map[string]int
	// probing: the probe loop runs.
	probing bool
	// trials counts the trials begun, so that a probe loop tells its own from a later one.
	trials int
}

func newOutage(c *consumer, db *sqldb.DB) *outage {
	o := &outage{c: c, wake: make(chan struct{}), given: map[string]int{}}
	if db != nil {
		o.probe = func(ctx context.Context) error { return sqldb.Probe(ctx, db) }
	}
	return o
}

// paused reports whether the handler is paused and takes no delivery (a trial is not).
func (o *outage) paused() bool { return o.state.Load() == outagePaused }

// wait returns once the handler may receive a delivery: at once while it runs or tries a
// delivery, later while it is paused; or when closing is closed.
func (o *outage) wait(closing <-chan struct{}) {
	for o.state.Load() == outagePaused {
		o.mu.Lock()
		wake := o.wake
		paused := o.state.Load() == outagePaused
		o.mu.Unlock()
		if !paused {
			return
		}
		select {
		case <-wake:
		case <-closing:
			return
		}
	}
}

// admit reports whether a delivery that a reader received may start: at once while the handler
// runs; during an outage once it is the trial delivery, or once the handler runs again. It
// reports false when the delivery's context, msgCtx, ends first, true when closing is closed.
// msgCtx is asked for its Done channel only during an outage: a context makes that channel
// when first asked, and a delivery of a running handler should not pay for it.
func (o *outage) admit(msgCtx context.Context, closing <-chan struct{}) bool {
	for o.state.Load() != outageNone {
		ended := msgCtx.Done()
		select {
		case <-ended:
			return false
		default:
		}
		o.mu.Lock()
		switch o.state.Load() {
		case outageNone:
			o.mu.Unlock()
			return true
		case outageTrial:
			if !o.trialTaken {
				o.trialTaken = true
				o.mu.Unlock()
				return true
			}
		}
		wake := o.wake
		o.mu.Unlock()
		select {
		case <-wake:
		case <-ended:
			return false
		case <-closing:
			return true
		}
	}
	return true
}

// abandon gives the trial up when its delivery ends without an outcome (the router closes, it
// expired waiting for its turn): another reader takes the next one.
func (o *outage) abandon() {
	if o.state.Load() != outageTrial {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.state.Load() == outageTrial && o.trialTaken {
		o.trialTaken = false
		o.wakeLocked()
	}
}

// wakeLocked wakes the waiting readers.
func (o *outage) wakeLocked() {
	close(o.wake)
	o.wake = make(chan struct{})
}

// uncountedOf returns how many deliveries of md were given back during outages: deliveries
// the delivery limit does not count. Its id (counterID) is looked up only when there are some.
func (o *outage) uncountedOf(md *messagedata.MessageData) int {
	if o.uncounted.Load() == 0 {
		return 0
	}
	id := counterID(md)
	if id == "" {
		return 0
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.given[id]
}

// forget drops the given-back deliveries of md, which was acknowledged. Its id (counterID) is
// looked up only when there are some: an acknowledgement without an outage costs nothing here.
func (o *outage) forget(md *messagedata.MessageData) {
	if o.uncounted.Load() == 0 {
		return
	}
	id := counterID(md)
	if id == "" {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.given[id]; ok {
		delete(o.given, id)
		o.uncounted.Add(-1)
	}
}

// note records a delivery of the message with id (empty for none) given back uncounted.
func (o *outage) note(id string) {
	if id == "" {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.noteLocked(id)
}

func (o *outage) noteLocked(id string) {
	if _, ok := o.given[id]; ok || len(o.given) < outageMaxUncounted {
		if !ok {
			o.uncounted.Add(1)
		}
		o.given[id]++
	}
}

// fail records a delivery of the message with id (empty for none) given back because of err,
// an outage, and pauses the handler unless it is paused already. A trial that fails pauses it
// again, without a new log line.
func (o *outage) fail(id string, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if id != "" {
		o.noteLocked(id)
	}
	switch o.state.Load() {
	case outagePaused:
		return
	case outageNone:
		o.since, o.reason = time.Now(), outageReason(err)
		o.c.stats.set(StatePaused, o.reason, StateRunning)
		o.c.logger.Warn("handler paused: a failure that is not its messages'; deliveries are given back uncounted until it is over",
			"reason", o.reason, "error", err)
	}
	o.trialTaken = false
	o.state.Store(outagePaused)
	if !o.probing {
		o.probing = true
		go o.probeLoop()
	}
}

// ok records that a delivery had an outcome of its own message's: a paused handler runs again.
func (o *outage) ok() {
	if o.state.Load() == outageNone {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.state.Load() == outageNone {
		return
	}
	o.state.Store(outageNone)
	o.trialTaken = false
	o.wakeLocked()
	o.c.stats.set(StateRunning, "", StatePaused)
	o.c.logger.Info("handler resumed after an outage", "paused_for", time.Since(o.since).Round(time.Millisecond), "reason", o.reason)
}

// probeLoop waits, with a backoff, for the probe to pass, then lets a trial delivery through;
// it ends then, or when the router closes.
func (o *outage) probeLoop() {
	closing := o.c.router.closing
	wait := outageMinBackoff
	for {
		t := time.NewTimer(wait)
		select {
		case <-closing:
			t.Stop()
			o.mu.Lock()
			o.probing = false
			o.mu.Unlock()
			return
		case <-t.C:
		}
		wait = min(2*wait, outageMaxBackoff)
		if o.probe != nil {
			ctx, cancel := context.WithTimeout(context.Background(), outageProbeTimeout)
			err := o.probe(ctx)
			cancel()
			if err != nil {
				o.c.logger.Debug("outage probe failed; the handler stays paused", "error", err, "next_probe_in", wait)
				continue
			}
		}
		o.mu.Lock()
		if o.state.Load() == outagePaused {
			o.state.Store(outageTrial)
			o.trialTaken = false
			o.trials++
			o.wakeLocked()
		}
		trial := o.trials
		o.probing = false
		o.mu.Unlock()
		o.watchTrial(trial)
		return
	}
}

// outageTrialPatience is how long a trial delivery may take before another may go.
const outageTrialPatience = 30 * time.Second

// watchTrial watches the trial it began: when no delivery comes to try (the queue is empty),
// nothing tells the handler it is still paused, and it runs again; when the delivery taken
// for it takes longer than outageTrialPatience, another may go.
func (o *outage) watchTrial(trial int) {
	closing := o.c.router.closing
	began := time.Now()
	for {
		t := time.NewTimer(outageMaxBackoff)
		select {
		case <-closing:
			t.Stop()
			return
		case <-t.C:
		}
		o.mu.Lock()
		mine := o.state.Load() == outageTrial && o.trials == trial
		taken := o.trialTaken
		o.mu.Unlock()
		switch {
		case !mine:
			return
		case !taken:
			o.ok()
			return
		case time.Since(began) > outageTrialPatience:
			o.abandon()
			began = time.Now()
		}
	}
}

// outageReason says in a phrase what err, an outage, is.
func outageReason(err error) string {
	switch {
	case errors.Is(err, middleware.ErrDeadLetterFailed):
		return "the dead-letter broker refuses messages"
	case sqldb.Classify(err) == sqldb.ReadOnly:
		return "the database refuses writes"
	case sqldb.Classify(err) == sqldb.Connection:
		return "the database is unreachable"
	}
	return "a failure that is not the messages'"
}
