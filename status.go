package onceflow

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file holds the router's read-only status: what each handler is doing and what it has
// counted, for an operator's console or a health endpoint.

// StateKind says whether a handler takes deliveries.
type StateKind string

// The kinds of State.
const (
	// StateRunning: the handler's subscriptions are open and it takes deliveries.
	StateRunning StateKind = "running"
	// StatePaused: the handler is held back by a failure that is not its messages' (the
	// database unreachable or read-only, the dead-letter broker refusing messages), and takes
	// no deliveries until it is over, but one now and then to tell. It gives back the
	// deliveries it held, uncounted, and runs again by itself once the failure is over.
	StatePaused StateKind = "paused"
	// StateStopped: the handler takes no deliveries: the router has not run yet, has closed,
	// or the handler's subscriptions have ended.
	StateStopped StateKind = "stopped"
)

// State is what a handler is doing, why, and since when.
type State struct {
	Kind StateKind
	// Reason says why the handler is paused or stopped; empty while it runs.
	Reason string
	// Since is when the handler entered the state.
	Since time.Time
}

// HandlerCounts are a handler's deliveries since the router was made, by outcome: each
// delivery is counted once, when the router acknowledges or rejects it. They are the
// outcomes of the onceflow.messages metric, counted beside it by the router so that they do
// not depend on the chain holding the metrics interceptor.
type HandlerCounts struct {
	// Processed deliveries committed their effects and were acknowledged.
	Processed int64
	// Duplicates were recognised as applied before and acknowledged without processing.
	Duplicates int64
	// DeadLettered were published to the dead-letter topic and acknowledged.
	DeadLettered int64
	// DeliveryLimit are the dead-lettered deliveries given up at the handler's delivery limit
	// (middleware.ErrDeliveryLimit), among DeadLettered.
	DeliveryLimit int64
	// Failed deliveries were rejected (nacked) after an error, to be delivered again.
	Failed int64
	// Panicked deliveries were rejected after their processor panicked.
	Panicked int64
	// GivenBack deliveries failed by an outage (a failure that is not the message's, which
	// pauses the handler) and were handed back to the broker, not counted against the
	// delivery limit.
	GivenBack int64
}

// Total returns the deliveries counted.
func (c HandlerCounts) Total() int64 {
	return c.Processed + c.Duplicates + c.DeadLettered + c.Failed + c.Panicked + c.GivenBack
}

// HandlerStatus is one handler's status: what it is, what it is doing, and what it counted.
type HandlerStatus struct {
	Name  string
	Topic string
	// QoS is the handler's quality of service, which its chain carries.
	QoS   QoS
	State State
	// InFlight is how many of its deliveries are being processed now.
	InFlight int
	Counts   HandlerCounts
}

// Status returns the status of each handler, in the order they were added. It only reads
// what the router keeps in memory: it is cheap, safe to call at any time and concurrently,
// and changes nothing.
func (r *Router) Status() []HandlerStatus {
	r.mu.Lock()
	handlers := append([]*consumer(nil), r.handlers...)
	r.mu.Unlock()
	out := make([]HandlerStatus, len(handlers))
	for i, c := range handlers {
		out[i] = HandlerStatus{
			Name:     c.name,
			Topic:    c.topic,
			QoS:      c.stats.qos,
			State:    c.stats.state(),
			InFlight: len(c.slots),
			Counts:   c.stats.counts(),
		}
	}
	return out
}

// handlerStats is what the router counts of one handler's deliveries, and its state. A
// delivery costs an atomic add: no lock, no allocation.
type handlerStats struct {
	qos QoS

	processed, duplicates, deadLettered, deliveryLimit, failed, panicked, givenBack atomic.Int64

	mu  sync.Mutex
	now State
}

func newHandlerStats(qos QoS) *handlerStats {
	return &handlerStats{qos: qos, now: State{Kind: StateStopped, Reason: "the router has not run yet", Since: time.Now()}}
}

// record counts a delivery that ended with err, whose outcome is outcome.
func (s *handlerStats) record(outcome processor.Outcome, err error) {
	switch outcome {
	case processor.Processed:
		s.processed.Add(1)
	case processor.Duplicate:
		s.duplicates.Add(1)
	case processor.DeadLettered:
		s.deadLettered.Add(1)
		if errors.Is(err, middleware.ErrDeliveryLimit) {
			s.deliveryLimit.Add(1)
		}
	case processor.Panicked:
		s.panicked.Add(1)
	default:
		s.failed.Add(1)
	}
}

func (s *handlerStats) counts() HandlerCounts {
	return HandlerCounts{
		Processed:     s.processed.Load(),
		Duplicates:    s.duplicates.Load(),
		DeadLettered:  s.deadLettered.Load(),
		DeliveryLimit: s.deliveryLimit.Load(),
		Failed:        s.failed.Load(),
		Panicked:      s.panicked.Load(),
		GivenBack:     s.givenBack.Load(),
	}
}

func (s *handlerStats) state() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.now
}

// set moves the handler to kind for reason, unless it is in kind already; when from is not
// empty, only from that kind.
func (s *handlerStats) set(kind StateKind, reason string, from StateKind) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.now.Kind == kind || from != "" && s.now.Kind != from {
		return
	}
	s.now = State{Kind: kind, Reason: reason, Since: time.Now()}
}

// setStates moves each of handlers to kind for reason, as handlerStats.set does.
func setStates(handlers []*consumer, kind StateKind, reason string, from StateKind) {
	for _, c := range handlers {
		c.stats.set(kind, reason, from)
	}
}
