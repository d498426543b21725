package kafka

import (
	"context"
	"sync"
	"time"
)

// handOutGate is where a subscription hands out its records. A record that a member before
// may have been delivering when it stopped is handed out alone: once no delivery of the
// subscription is in flight and every ack given is committed (so that what was done before
// it is not done again if it kills the process), and with nothing else handed out until its
// delivery ends. A message that kills its consumer then
// takes no other record with it, and the records around it are not counted with it towards
// their delivery limits. Such records are few: those a member was delivering, or had taken
// to deliver next, when it died or when its revoke stopped waiting.
//
// No wait at the gate lasts longer than aloneWait: a slow delivery in flight, or a slow
// record handed out alone, holds the others back that long at most, and the isolation is
// then given up for that hand-out. The other subscriptions of the process are not held back:
// what they have in flight when such a record kills the process comes back with it.

// aloneWait bounds every wait at the gate.
const aloneWait = time.Second

// handOutGate: see above. The zero value is not usable: changed must be made.
type handOutGate struct {
	mu      sync.Mutex
	live    int // deliveries in flight
	unsent  int // acks not yet committed
	alone   int // deliveries in flight alone
	waiting int // records waiting to be handed out alone: the others wait behind them
	changed chan struct{}
}

// enter waits until a delivery may be handed out (alone, if alone is true), or aloneWait has
// passed, and counts it in flight; it reports false if ctx ends first.
func (g *handOutGate) enter(ctx context.Context, alone bool) bool {
	timer := time.NewTimer(aloneWait)
	defer timer.Stop()
	late := false
	g.mu.Lock()
	if alone {
		g.waiting++
		defer func() {
			g.mu.Lock()
			g.waiting--
			g.broadcastLocked()
			g.mu.Unlock()
		}()
	}
	for {
		open := g.alone == 0 && (alone && g.live == 0 && g.unsent == 0 || !alone && g.waiting == 0)
		if open || late {
			g.live++
			if alone {
				g.alone++
			}
			g.mu.Unlock()
			return true
		}
		ch := g.changed
		g.mu.Unlock()
		select {
		case <-ch:
		case <-timer.C:
			late = true
		case <-ctx.Done():
			return false
		}
		g.mu.Lock()
	}
}

// leave counts a delivery that enter let through out of flight.
func (g *handOutGate) leave(alone bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.live--
	if alone {
		g.alone--
	}
	g.broadcastLocked()
}

// acked adds n to the acks not yet committed (n < 0 when a commit carried them, or their
// partition is dropped).
func (g *handOutGate) acked(n int) {
	if n == 0 {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.unsent += n
	if g.unsent == 0 {
		g.broadcastLocked()
	}
}

func (g *handOutGate) broadcastLocked() {
	close(g.changed)
	g.changed = make(chan struct{})
}
