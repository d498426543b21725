package outbox

import "time"

// verdict is what a relay does with a message whose publish failed.
type verdict int

const (
	// sendLater: nack it, to be sent again after a delay that grows with its delivery count,
	// and go on with the messages behind it.
	sendLater verdict = iota
	// holdInPlace: the destination fails every message; publish this one again, in place,
	// after a growing pause, and take no other meanwhile.
	holdInPlace
	// deadLetter: the destination refuses this message; publish it to the dead-letter topic.
	deadLetter
)

// maxRemembered bounds the messages whose first failure a relay remembers.
const maxRemembered = 10000

// health is what a relay has seen of its destination, to tell a message the destination
// refuses from a destination that is down. A message is refused when the destination keeps
// failing it while it accepts others: it is dead-lettered once it has been delivered
// MaxAttempts times (a durable count, kept in its lease) and the destination has accepted
// another message since this relay first saw it fail. The destination is down when the
// publishes of two different messages fail one after the other with nothing accepted in
// between: then no failure counts against a message, and the relay holds the one it has and
// tries it again in place until the destination accepts it. Only the relay's loop uses it.
type health struct {
	// accepted counts the publishes the destination accepted.
	accepted uint64
	// lastFailed is the row whose publish failed last; "" once a publish succeeds.
	lastFailed string
	// down: two different messages failed in a row, and nothing was accepted since.
	down bool
	// firstFailure maps a row that failed to the value of accepted at its first failure.
	firstFailure map[string]uint64
}

func newHealth() *health { return &health{firstFailure: map[string]uint64{}} }

// succeeded records that the destination accepted row.
func (h *health) succeeded(row string) {
	h.accepted++
	h.lastFailed, h.down = "", false
	delete(h.firstFailure, row)
}

// failed records that the destination failed row at its deliveries-th delivery, and returns
// what to do with it: dead-letter it when refused (the error says that publishing again cannot
// succeed) or when it has reached maxAttempts with evidence that the destination works; hold
// it when the destination is down; send it later otherwise.
func (h *health) failed(row string, deliveries, maxAttempts int, refused bool) verdict {
	if refused {
		delete(h.firstFailure, row)
		return deadLetter
	}
	if h.lastFailed != "" && h.lastFailed != row {
		h.down = true
	}
	h.lastFailed = row
	first, seen := h.firstFailure[row]
	if !seen {
		if len(h.firstFailure) >= maxRemembered {
			for k := range h.firstFailure { // forget one: its evidence starts again
				delete(h.firstFailure, k)
				break
			}
		}
		h.firstFailure[row] = h.accepted
	}
	switch {
	case h.down:
		return holdInPlace
	case seen && h.accepted > first && deliveries >= maxAttempts:
		delete(h.firstFailure, row)
		return deadLetter
	}
	return sendLater
}

// settled forgets row, which left the relay by another way (dead-lettered).
func (h *health) settled(row string) { delete(h.firstFailure, row) }

// backoff returns the delay before the next attempt of a message that failed at its n-th
// delivery (or n-th attempt in place): base doubled n-1 times, at most ceiling.
func backoff(n int, base, ceiling time.Duration) time.Duration {
	d := base
	for i := 1; i < n && d < ceiling; i++ {
		d *= 2
	}
	return min(d, ceiling)
}
