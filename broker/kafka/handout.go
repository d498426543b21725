package kafka

import (
	"cmp"
	"slices"
	"time"

	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/messagedata"
)

// This file hands out a subscription's records, in the order of its queue (pumpLocked).

// queueLocked makes the next hand-out of e and queues it if the group's metadata covers it
// (ready), or otherwise puts it with the deliveries that wait for the next commit; it reports
// whether the queue grew. sub.mu is held.
func (sub *subscription) queueLocked(p *partition, e *entry) (*delivery, bool) {
	d := &delivery{p: p, e: e}
	if p.ready(e) {
		return d, sub.readyLocked(d)
	}
	e.waiting = true
	p.pending = append(p.pending, d)
	return d, false
}

// readyLocked queues d, whose hand-out is ready, and reports whether the queue grew. A
// subscription that hands out records in order (positions) holds it instead until every
// record before it in its partition is acked (releaseLocked). sub.mu is held.
func (sub *subscription) readyLocked(d *delivery) bool {
	if sub.positions == nil {
		sub.queue = append(sub.queue, d)
		return true
	}
	p := d.p
	i, _ := slices.BinarySearchFunc(p.held, d.e.offset, func(h *delivery, o int64) int { return cmp.Compare(h.e.offset, o) })
	p.held = slices.Insert(p.held, i, d)
	return sub.releaseLocked(p)
}

// releaseLocked queues the hand-outs held for p whose turn it is, and reports whether the
// queue grew: one at a time, the hand-out of p's first record not acked, so that at most one
// record of p is out at once; with a window, each held hand-out in order while p.inOrder
// allows it. sub.mu is held.
func (sub *subscription) releaseLocked(p *partition) bool {
	grew := false
	for len(p.held) > 0 && len(p.entries) > 0 {
		h := p.held[0]
		if sub.window && !p.inOrder(h.e) || !sub.window && h.e != p.entries[0] {
			break
		}
		h.e.out = true
		sub.queue = append(sub.queue, h)
		p.held[0] = nil
		p.held = p.held[1:]
		grew = true
	}
	return grew
}

// aloneWait bounds every wait at the gate of pumpLocked.
const aloneWait = time.Second

// pumpLocked emits the queued deliveries in order, as far as their turn has come, and drops
// those of the partitions being revoked. Each place where a turn may come calls it: the
// queue grew, a commit recorded hand-outs, a delivery ended while the head of the queue
// waited at the gate, or aloneWait passed. sub.mu is held.
//
// A record that a member before may have been delivering when it stopped (unknownCount) is
// handed out alone: once nothing of the subscription is in flight and every ack given is
// committed, and with nothing else handed out until its delivery ends. A message that kills
// its consumer then takes no other record with it, nor counts towards their delivery limits.
// Such records are few: those a member was delivering, or had taken to deliver next, when it
// died or when its revoke stopped waiting. No wait at this gate lasts longer than aloneWait:
// then the isolation is given up for that hand-out. Other subscriptions of the process are
// not held back.
func (sub *subscription) pumpLocked() {
	sub.gated = false
	for len(sub.queue) > 0 && !sub.sub.Stopped() {
		d := sub.queue[0]
		switch {
		case d.p.gone || d.p.revoking:
			sub.unkeepLocked(d)
		case d.e.deliveries == 0 && d.e.offset >= d.p.horizon:
			// A first hand-out: the group's metadata must say it was taken first. Ask the
			// next commit to cover it and the first hand-outs queued behind it.
			sub.wantLocked()
			inflight.Signal(sub.commit)
			return
		case !sub.openLocked(d):
			sub.gated = true
			return
		}
		sub.queue[0] = nil
		sub.queue = sub.queue[1:]
		if !d.p.gone && !d.p.revoking && !sub.emitLocked(d) {
			return
		}
	}
}

// openLocked reports whether the gate (see pumpLocked) lets d through: nothing is out alone,
// and for a record of unknown count, nothing is in flight and every ack is committed; or d
// has waited aloneWait. sub.mu is held.
func (sub *subscription) openLocked(d *delivery) bool {
	if sub.alone == 0 && (!d.e.unknownCount || sub.live == 0 && !sub.unsentLocked()) {
		return true
	}
	if sub.atGate != d {
		sub.atGate, sub.lateAt = d, time.Now().Add(aloneWait)
		sub.late.Reset(aloneWait)
	}
	return !time.Now().Before(sub.lateAt)
}

// unsentLocked reports whether an ack given is not committed yet. sub.mu is held.
func (sub *subscription) unsentLocked() bool {
	for _, p := range sub.parts {
		if p.acks > p.ackCommitted {
			return true
		}
	}
	return false
}

// emitLocked gives d to the engine to hand out, with its message and its position, and
// reports false when the subscription is stopping. It is emitted under sub.mu, so that a
// revoke that drops its partition after finds it in the engine. sub.mu is held.
func (sub *subscription) emitLocked(d *delivery) bool {
	d.e.deliveries++
	msg := Message(d.e.rec)
	messagedata.Position{Partition: d.e.rec.Partition, Offset: d.e.offset, Previous: d.p.previous(d.e)}.SetHeaders(msg.Metadata)
	kept := d.kept
	if kept {
		d.kept = false
		d.p.kept--
	}
	if sub.sub.Emit(inflight.Item[*delivery]{Data: d, Msg: msg, Count: d.e.deliveries, Kept: kept}) == nil {
		return false
	}
	// The engine tells Settle how d ends once sub.mu is free.
	d.live, d.alone = true, d.e.unknownCount
	d.p.live++
	sub.live++
	if d.alone {
		sub.alone++
	}
	return true
}

// unkeepLocked gives back the place of the window that d holds, if it holds one: it will not
// be handed out (its partition is being revoked). sub.mu is held.
func (sub *subscription) unkeepLocked(d *delivery) {
	if d.kept && !d.p.gone {
		d.kept = false
		d.p.kept--
		sub.sub.Release(1)
	}
}

// wantLocked sets, for the partitions of the first hand-outs at the head of the queue, the
// taken offset the next commit is to record: up to a quarter of the window ahead, and not
// past a record handed out alone (which may kill its consumer: the records behind it must
// not count as handed out with it). sub.mu is held.
func (sub *subscription) wantLocked() {
	ahead := max(sub.prefetch/4, 1)
	for i, d := range sub.queue {
		if i == ahead || (i > 0 && d.e.unknownCount) {
			return
		}
		if d.e.deliveries == 0 && !d.p.gone {
			d.p.want = max(d.p.want, d.e.offset+1)
		}
		if d.e.unknownCount {
			continue
		}
		// In order, the records held behind it are handed out next, one at a time: one
		// commit covers them too.
		for j, h := range d.p.held {
			if j == ahead || h.e.unknownCount {
				break
			}
			if h.e.deliveries == 0 && !d.p.gone {
				d.p.want = max(d.p.want, h.e.offset+1)
			}
		}
	}
}

// unliveLocked takes d off the deliveries in flight; sub.mu is held.
func (sub *subscription) unliveLocked(d *delivery) {
	if !d.live {
		return
	}
	d.live = false
	p := d.p
	p.live--
	sub.live--
	if d.alone {
		sub.alone--
	}
	if p.live == 0 && p.drained != nil {
		close(p.drained)
		p.drained = nil
	}
	if sub.gated {
		sub.pumpLocked()
	}
}
