package amqp

// tagState is what a subscription knows of one delivery tag of its channel.
type tagState uint8

const (
	// open: delivered, neither acked nor nacked by the consumer yet.
	open tagState = iota
	// acked by the consumer; the ack is not sent yet.
	acked
	// held: nacked by the consumer, waiting for its delay before the nack is sent.
	held
	// gone: settled at RabbitMQ (ack or nack sent).
	gone
)

// window tracks the delivery tags of one AMQP channel that RabbitMQ counts as unacked, and
// says how to send the acks the consumer gave in as few frames as possible. Tags on a channel
// are 1, 2, 3, ... in delivery order (the channel has one consumer and no basic.get). An ack
// with multiple set settles every unacked tag up to its own, so it may only cover a run of
// tags that are all acked (or already settled): never an open or held one. The session's mutex
// guards it.
type window struct {
	// base is the highest tag below which every tag is gone.
	base uint64
	// states[i] is the state of tag base+1+i; states[0] is never gone.
	states []tagState
	// nAcked counts the acked tags, nOpen the open ones.
	nAcked, nOpen int
}

// add records the delivery of tag. A tag below or at one already known is ignored; a gap
// (which a consume-only channel never has) is recorded as gone.
func (w *window) add(tag uint64) {
	next := w.base + uint64(len(w.states)) + 1
	if tag < next {
		return
	}
	for ; next < tag; next++ {
		w.states = append(w.states, gone)
	}
	w.states = append(w.states, open)
	w.nOpen++
	w.trim()
}

// state returns the state of tag: gone for a tag the window does not know.
func (w *window) state(tag uint64) tagState {
	if tag <= w.base || tag > w.base+uint64(len(w.states)) {
		return gone
	}
	return w.states[tag-w.base-1]
}

// set moves tag to state s, keeping the counts.
func (w *window) set(tag uint64, s tagState) {
	old := w.state(tag)
	if old == gone || old == s {
		return
	}
	switch old {
	case open:
		w.nOpen--
	case acked:
		w.nAcked--
	}
	switch s {
	case open:
		w.nOpen++
	case acked:
		w.nAcked++
	}
	w.states[tag-w.base-1] = s
	if s == gone {
		w.trim()
	}
}

// trim advances base over the gone tags at the front.
func (w *window) trim() {
	i := 0
	for i < len(w.states) && w.states[i] == gone {
		i++
	}
	if i == 0 {
		return
	}
	w.base += uint64(i)
	w.states = w.states[i:]
	if len(w.states) == 0 {
		w.states = w.states[:0:0] // let the old array go
	}
}

// prefixReady reports whether the oldest tag not settled at RabbitMQ is acked: a multiple ack
// can go.
func (w *window) prefixReady() bool { return len(w.states) > 0 && w.states[0] == acked }

// prefix returns the run of acked tags at the front of the window, which ends at an open or
// held tag, or at the end: the index of its last acked tag, one ack of which settles it all,
// and how many acked tags it holds.
func (w *window) prefix() (last, n int) {
	for i := 0; i < len(w.states) && (w.states[i] == acked || w.states[i] == gone); i++ {
		if w.states[i] == acked {
			last, n = i, n+1
		}
	}
	return last, n
}

// take returns the acks to send now, and records them as sent: the prefix as one frame (with
// multiple set when it holds more than one), and, with all, each other acked tag alone.
func (w *window) take(all bool) []ackFrame {
	var frames []ackFrame
	last, n := w.prefix()
	if n > 0 {
		frames = append(frames, ackFrame{tag: w.base + uint64(last) + 1, multiple: n > 1})
		for j := range last + 1 {
			w.states[j] = gone
		}
		w.nAcked -= n
	}
	if all && w.nAcked > 0 {
		for j, s := range w.states {
			if s == acked {
				frames = append(frames, ackFrame{tag: w.base + uint64(j) + 1})
				w.states[j] = gone
			}
		}
		w.nAcked = 0
	}
	w.trim()
	return frames
}
