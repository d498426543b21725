package kafka

import (
	"cmp"
	"slices"

	"github.com/twmb/franz-go/pkg/kgo"
)

// partition is the books of one partition the subscription owns: its records taken, the order
// in which they may be handed out, and the mark below which every record is acked.
type partition struct {
	id   int32
	gone bool // revoked or lost: its deliveries are void
	// revoking is set while a revoke waits for the deliveries handed out to settle: nothing
	// more of the partition is handed out. drained, if not nil, is closed when live empties.
	revoking bool
	drained  chan struct{}
	// unknownUntil is the offset below which a record taken may have been delivered by a
	// member that owned the partition before: see take.
	unknownUntil int64
	// horizon is the taken offset in the group's committed metadata (the records below it may
	// be handed out first), want the one the next commit is to record; pending are the
	// redeliveries waiting for a commit to record them (see ready).
	horizon int64
	want    int64
	pending []*delivery
	// inherited are the acked spans of the member before (see metadata.go): records in them
	// are taken as acked, not delivered.
	inherited []span
	// acks counts the acks booked, ackCommitted those that a commit has carried.
	acks, ackCommitted int
	entries            []*entry // not yet below the commit mark, in offset order
	// next and epoch are the offset after the last record taken, and that record's leader
	// epoch: the commit mark when entries is empty.
	next      int64
	epoch     int32
	committed int64 // the last mark committed, -1 for none
	// kept counts the deliveries of the partition that hold a place of the window Fetch kept
	// for them (delivery.kept), and live those emitted and not ended.
	kept, live int
	// held are, in a subscription that hands out records in order, the hand-outs ready to
	// queue that wait for the records before them to be acked, in offset order.
	held []*delivery
}

// entry is one record in the books.
type entry struct {
	rec    *kgo.Record // nil once acked
	offset int64
	epoch  int32
	acked  bool
	// deliveries counts this subscription's deliveries of the record.
	deliveries int
	// unknownCount marks a record that a member before this one may have been delivering
	// when it stopped (see take): it is handed out alone.
	unknownCount bool
	// recorded is how many hand-outs of the record the group's committed metadata covers
	// (see ready).
	recorded int
	waiting  bool // its next hand-out waits in pending for a commit
	// out is set, in a subscription that hands out records in order, while a hand-out of the
	// record is queued or handed out and not settled.
	out bool
}

// inOrder reports whether a hand-out of e may be queued in a subscription with a window: a
// first one when every record before e that is not acked is out (queued or handed out), so
// that the consumer has them all, in order; a redelivery when every record before e is acked,
// so that a nacked record comes again before the ones behind it, which wait for it (their
// predecessor failed: they would fail behind it again).
func (p *partition) inOrder(e *entry) bool {
	for _, x := range p.entries {
		switch {
		case x == e:
			return true
		case x.acked:
		case e.deliveries > 0 || !x.out:
			return false
		}
	}
	return false
}

// ready reports whether e's next hand-out may be queued: a first one always (the sender
// waits for the taken offset to pass it, see send), the n-th (n >= 2) once the group's
// committed metadata records n, so that a member that takes the partition over after it sees
// the hand-out.
func (p *partition) ready(e *entry) bool {
	return e.deliveries == 0 || e.recorded > e.deliveries
}

// takenFinal is the taken offset of the last commit of p, once every delivery of it has ended:
// the offset after the last record handed out (a delivery the consumer never took is not
// counted, see Settle), and never less than unknownUntil, which a member before may have
// handed out.
func (p *partition) takenFinal() int64 {
	taken := p.unknownUntil
	for _, e := range p.entries {
		if e.deliveries > 0 {
			taken = max(taken, e.offset+1)
		}
	}
	return taken
}

// counts returns the hand-outs to record of the unacked entries handed out or to be handed
// out more than once (a first hand-out is recorded by the taken offset), and whether one of
// them is more than the metadata has.
func (p *partition) counts() (map[int64]int, bool) {
	var out map[int64]int
	grew := false
	for _, e := range p.entries {
		n := e.deliveries
		if e.waiting {
			n++ // its next hand-out waits to be recorded
		}
		if e.acked || n < 2 {
			continue
		}
		if out == nil {
			out = map[int64]int{}
		}
		out[e.offset] = n
		grew = grew || n > e.recorded
	}
	return out, grew
}

// previous returns the offset of the last record before e in p's books that is not acked, -1
// for none (messagedata.HeaderPreviousOffset): the record that the consumer has to apply
// before e. The records before e that are acked (processed, duplicates, dead-lettered) or
// below the commit mark need nothing more.
func (p *partition) previous(e *entry) int64 {
	i, _ := slices.BinarySearchFunc(p.entries, e.offset, func(x *entry, o int64) int { return cmp.Compare(x.offset, o) })
	for i--; i >= 0; i-- {
		if !p.entries[i].acked {
			return p.entries[i].offset
		}
	}
	return -1
}

// popAcked takes the acked entries at the front out of the books and returns how many.
func (p *partition) popAcked() int {
	n := 0
	for n < len(p.entries) && p.entries[n].acked {
		p.entries[n] = nil
		n++
	}
	p.entries = p.entries[n:]
	return n
}

// spans returns the acked spans behind the commit mark: those of the books, and those
// inherited that lie beyond the records taken.
func (p *partition) spans() []span {
	var out []span
	open := false
	for _, e := range p.entries {
		switch {
		case !e.acked:
			open = false
		case open:
			out[len(out)-1].to = e.offset
		default:
			out = append(out, span{e.offset, e.offset})
			open = true
		}
	}
	for _, sp := range p.inherited {
		if sp.to >= p.next {
			out = append(out, span{max(sp.from, p.next), sp.to})
		}
	}
	return out
}

// mark returns the commit mark of p: the offset of its first entry not acked, or the offset
// after the last record taken.
func (p *partition) mark() kgo.EpochOffset {
	if len(p.entries) > 0 {
		return kgo.EpochOffset{Epoch: p.entries[0].epoch, Offset: p.entries[0].offset}
	}
	return kgo.EpochOffset{Epoch: p.epoch, Offset: p.next}
}
