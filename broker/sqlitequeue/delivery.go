package sqlitequeue

import (
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// lease is what a delivery keeps of the lease it was claimed under, to settle it.
type lease struct {
	offset     int64
	deliveries int      // the lease's count, which names the lease
	claim      claimRef // the claim row that holds the lease; zero for a lease row
}

// Settle turns the end of a delivery into the settlement of its lease, for the next
// transaction to commit: deleted when acked, visible after the nack's delay when nacked, given
// back otherwise, its count taken back if it was never handed out, unless its lease passed
// after the hand-out: the message may be claimed again already.
func (s *subscription) Settle(d *inflight.Delivery[lease], o inflight.Outcome) {
	s.live.Add(-1)
	now := time.Now()
	st := settlement{offset: d.Data.offset, deliveries: d.Data.deliveries, claim: d.Data.claim, from: s}
	switch {
	case o.Acked:
		st.ack = true
	case o.Nacked:
		st.visibleAt = now.Add(o.Delay)
	default:
		handed := d.HandedOut()
		if handed && errors.Is(o.Cause, errLeasePassed) {
			s.logger.Info("Message not acknowledged within the ack deadline; it will be delivered again",
				watermill.LogFields{"msg_uuid": d.Msg.UUID, "ack_deadline": s.q.cfg.AckDeadline})
			return
		}
		st.visibleAt, st.undeliver = now, !handed
	}
	s.pending.add(st, now)
	s.gave.Store(true)
	inflight.Signal(s.kick)
}
