package amqp

import "sync"

// FrameCounter counts the acks and nacks a Subscriber sends, by kind.
type FrameCounter struct {
	mu                           sync.Mutex
	AckSingle, AckMultiple, Nack int
}

// Frames returns the counts so far.
func (c *FrameCounter) Frames() (ackSingle, ackMultiple, nack int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.AckSingle, c.AckMultiple, c.Nack
}

type countingAcker struct {
	acker
	c *FrameCounter
}

func (a countingAcker) Ack(tag uint64, multiple bool) error {
	a.c.mu.Lock()
	if multiple {
		a.c.AckMultiple++
	} else {
		a.c.AckSingle++
	}
	a.c.mu.Unlock()
	return a.acker.Ack(tag, multiple)
}

func (a countingAcker) Nack(tag uint64, multiple, requeue bool) error {
	a.c.mu.Lock()
	a.c.Nack++
	a.c.mu.Unlock()
	return a.acker.Nack(tag, multiple, requeue)
}

// CountFrames makes s count the acks and nacks of its subscriptions in c. Call it before the
// first Subscribe.
func CountFrames(s *Subscriber, c *FrameCounter) {
	s.wrapAcker = func(a acker) acker { return countingAcker{acker: a, c: c} }
}
