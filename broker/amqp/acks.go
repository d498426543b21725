package amqp

import "time"

// ackFrame is one basic.ack to send: with multiple, it settles every unsettled tag up to tag.
type ackFrame struct {
	tag      uint64
	multiple bool
}

// givenAck is an ack the consumer gave, and when.
type givenAck struct {
	tag uint64
	at  time.Time
}

// coalescer decides when the acks the consumer gives are sent, and as which frames, by the
// rules of Config.AckDelay (delay) and Config.OutOfOrderAckDelay (hold): a multiple ack settles
// the prefix (the run of acked tags from the oldest unsettled delivery) for the price of one.
// A delivery late compared to its neighbours is normally acked within outOfOrder; one that is
// stuck (retried, held after a nack) does not keep the acks behind it waiting longer. The
// session decides when the acks go for want of an open delivery (idleFlush): the consumer may
// ack a delivery before the session has received the next one RabbitMQ sent. It never sends an
// ack the consumer did not give (window.take). The session's mutex guards it.
type coalescer struct {
	win window
	// delay bounds the wait of a prefix ack, hold the wait of an ack behind an unsettled
	// delivery.
	delay, hold time.Duration
	// flushAt is half the window.
	flushAt int
	// mean is the moving mean of the time from hand-out to ack.
	mean time.Duration
	// given holds the acks not sent yet, oldest first from head; entries whose tag went out
	// since (in a multiple ack) are skipped.
	given []givenAck
	head  int
}

// meanWeight is the weight of the newest sample in coalescer.mean: about the last 64 acks count.
const meanWeight = 64

func newCoalescer(prefetch int, delay, hold time.Duration) *coalescer {
	return &coalescer{delay: delay, hold: max(hold, delay), flushAt: max(1, (prefetch+1)/2)}
}

// ack records the consumer's ack at now of tag, handed out took ago, and returns the frames to
// send now.
func (c *coalescer) ack(tag uint64, now time.Time, took time.Duration) []ackFrame {
	if c.win.state(tag) != open {
		return nil
	}
	if c.mean == 0 {
		c.mean = took
	} else {
		c.mean += (took - c.mean) / meanWeight
	}
	c.win.set(tag, acked)
	c.given = append(c.given, givenAck{tag: tag, at: now})
	if c.win.nAcked < c.flushAt {
		return nil
	}
	if _, n := c.win.prefix(); n >= c.flushAt {
		return c.take(false)
	}
	return nil
}

// nack records a nack of tag: held when the consumer nacked it and the nack waits, gone once
// the nack was sent.
func (c *coalescer) nack(tag uint64, s tagState) { c.win.set(tag, s) }

// idleFlush returns every ack waiting when no delivery is open.
func (c *coalescer) idleFlush() []ackFrame {
	if c.idleDue() {
		return c.flush()
	}
	return nil
}

// idleDue reports whether acks wait and no delivery is open: idleFlush would send them.
func (c *coalescer) idleDue() bool { return c.win.nAcked > 0 && c.win.nOpen == 0 }

// outOfOrder returns how long an ack behind an unsettled delivery waits for it.
func (c *coalescer) outOfOrder() time.Duration {
	return min(max(2*c.mean, c.delay), c.hold)
}

// due returns when expire should run next; false when no ack waits.
func (c *coalescer) due() (time.Time, bool) {
	c.skipSent()
	if c.head == len(c.given) {
		return time.Time{}, false
	}
	oldest := c.given[c.head].at
	if c.win.prefixReady() {
		// The oldest ack waiting may be behind the prefix, and older than its acks: the prefix
		// then goes early, never late.
		return oldest.Add(c.delay), true
	}
	return oldest.Add(c.outOfOrder()), true
}

// expire returns the frames due at now: the prefix when its delay has passed, and alone each
// ack that has waited for outOfOrder.
func (c *coalescer) expire(now time.Time) []ackFrame {
	c.skipSent()
	if c.head == len(c.given) {
		return nil
	}
	var frames []ackFrame
	if c.win.prefixReady() && !c.given[c.head].at.Add(c.delay).After(now) {
		frames = c.take(false)
	}
	wait := c.outOfOrder()
	for i := c.head; i < len(c.given) && !c.given[i].at.Add(wait).After(now); i++ {
		if t := c.given[i].tag; c.win.state(t) == acked {
			c.win.set(t, gone)
			frames = append(frames, ackFrame{tag: t})
		}
	}
	c.skipSent()
	return frames
}

// flushPrefix returns the prefix, when there is one, as one frame: the consumer has settled a
// batch together and the acks at the front need not wait for more.
func (c *coalescer) flushPrefix() []ackFrame { return c.take(false) }

// flush returns every ack waiting: the prefix as one frame, the others alone.
func (c *coalescer) flush() []ackFrame { return c.take(true) }

func (c *coalescer) take(all bool) []ackFrame {
	frames := c.win.take(all)
	c.skipSent()
	return frames
}

// skipSent drops the acks at the head of given that were sent.
func (c *coalescer) skipSent() {
	for c.head < len(c.given) && c.win.state(c.given[c.head].tag) != acked {
		c.head++
	}
	if c.head == len(c.given) {
		c.given, c.head = c.given[:0], 0
	} else if c.head > 1024 && c.head > len(c.given)/2 {
		n := copy(c.given, c.given[c.head:])
		clear(c.given[n:])
		c.given, c.head = c.given[:n], 0
	}
}
