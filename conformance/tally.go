package conformance

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/onceflow/onceflow"
)

// This file counts what the consumers of the Poison scenario report: each message's deliveries,
// acks, nacks, the acks given too late and the deliveries lost with a consumer that died.

// poisonCounts are the deliveries of one message to the consumers of a pool: Lost counts the
// deliveries that ended with the death of their consumer, neither acked nor nacked.
type poisonCounts struct {
	Deliveries, Acks, Nacks, Lost int
	// AcksLost counts the acks that the router gave after the delivery had ended (its ack
	// timeout passed first): the broker delivers the message again.
	AcksLost int
	// BrokerCount is the highest delivery count the broker gave the message (0 where it counts
	// none): above Deliveries when the broker handed it to a consumer that died before the
	// router saw it (a window of leases, a prefetch).
	BrokerCount int
	// First is when a consumer first reported a delivery of it.
	First time.Time
}

// tally counts the deliveries that the consumers of a pool report.
type tally struct {
	mu   sync.Mutex
	byID map[string]*poisonCounts
	open map[int]map[string]int // consumer -> message id -> deliveries not settled
	dead map[int]bool
	last time.Time // of the last delivery
}

func newTally() *tally {
	return &tally{byID: map[string]*poisonCounts{}, open: map[int]map[string]int{}, dead: map[int]bool{}}
}

// event records what consumer n reported; nothing is recorded of a consumer after its death.
func (t *tally) event(n int, kind byte, count int, id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dead[n] {
		return
	}
	c := t.byID[id]
	if c == nil {
		c = &poisonCounts{}
		t.byID[id] = c
	}
	open := t.open[n]
	if open == nil {
		open = map[string]int{}
		t.open[n] = open
	}
	switch kind {
	case 'd':
		if c.Deliveries == 0 {
			c.First = time.Now()
		}
		c.Deliveries++
		c.BrokerCount = max(c.BrokerCount, count)
		open[id]++
		t.last = time.Now()
	case 'a', 'n':
		if open[id] > 0 {
			open[id]--
		}
		if kind == 'a' {
			c.Acks++
		} else {
			c.Nacks++
		}
	case 'l':
		c.AcksLost++
	}
}

// died records the death of consumer n: the deliveries it had not settled are lost.
func (t *tally) died(n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dead[n] {
		return
	}
	t.dead[n] = true
	for id, k := range t.open[n] {
		t.byID[id].Lost += k
	}
	delete(t.open, n)
}

// inFlight returns the deliveries that live consumers have not settled, and the time of the
// last delivery.
func (t *tally) inFlight() (int, time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, open := range t.open {
		for _, k := range open {
			n += k
		}
	}
	return n, t.last
}

func (t *tally) get(id string) poisonCounts {
	t.mu.Lock()
	defer t.mu.Unlock()
	if c := t.byID[id]; c != nil {
		return *c
	}
	return poisonCounts{}
}

func (t *tally) counts(ids ...string) map[string]poisonCounts {
	out := make(map[string]poisonCounts, len(ids))
	for _, id := range ids {
		out[id] = t.get(id)
	}
	return out
}

// ackLostReporter passes log records on to its Handler, and reports the message id of each
// record whose error is onceflow.ErrAckLost: the delivery had ended before the router acked
// it, so the broker delivers the message again.
type ackLostReporter struct {
	slog.Handler
	report func(id string)
}

func (h ackLostReporter) Handle(ctx context.Context, r slog.Record) error {
	var id string
	lost := false
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "message_id":
			id = a.Value.String()
		case "error":
			err, ok := a.Value.Any().(error)
			lost = ok && errors.Is(err, onceflow.ErrAckLost)
		}
		return true
	})
	if lost {
		h.report(id)
	}
	return h.Handler.Handle(ctx, r)
}

func (h ackLostReporter) WithAttrs(attrs []slog.Attr) slog.Handler {
	return ackLostReporter{Handler: h.Handler.WithAttrs(attrs), report: h.report}
}

func (h ackLostReporter) WithGroup(name string) slog.Handler {
	return ackLostReporter{Handler: h.Handler.WithGroup(name), report: h.report}
}
