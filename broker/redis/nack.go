package redis

import (
	"container/heap"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// A nacked entry stays in the consumer's pending entries list, its delay kept as its idle
// time (the package documentation's Nack): a nack with delay d sets the idle time to
// AckTimeout - d (XCLAIM to itself with IDLE and JUSTID, which leaves the delivery count
// alone), so that claims, which take only entries idle for AckTimeout, take it d later; the
// nacking consumer claims it itself then (claims), without waiting for a claim pass. Redis
// caps the idle time it sets at the current time: a delay longer than AckTimeout sets it to 0
// and pushes it back every AckTimeout/2 (refreshes) until the rest is shorter.
//
// Every XCLAIM of an entry that should be ours carries a minimum idle time (guard) just below
// the idle time it must have if nobody claimed it since we last did: if another consumer took
// it (its idle time restarted), the XCLAIM does nothing and the entry is no longer ours.

// parked is a nacked entry waiting for its delay.
type parked struct {
	id  string
	due time.Time // the delay ends
	// At touchedAt the entry's idle time at the server was at least idle.
	touchedAt time.Time
	idle      time.Duration
	next      time.Time // when run acts on it: claims it, or pushes back its idle time (refresh)
	refresh   bool
	heap      *parkHeap // the heap it is queued in, nil when it is not queued
	index     int
}

// guard returns the minimum idle time of an XCLAIM that must take the entry only if it is
// still ours.
func (p *parked) guard(now time.Time) time.Duration {
	return max(floorMs(p.idle+now.Sub(p.touchedAt))-time.Millisecond, 0)
}

// plan returns the idle time to give the entry at now, whether it will need another push
// back, and how long after the XCLAIM returns run acts on it next.
func (p *parked) plan(now time.Time, ackTimeout time.Duration) (idle time.Duration, refresh bool, wait time.Duration) {
	rest := max(p.due.Sub(now), 0)
	if rest < ackTimeout {
		// The entry is claimable when its idle time reaches AckTimeout, which is rest from
		// now or a little later (milliseconds are rounded to that side); claim it just after.
		idle = max(floorMs(ackTimeout-rest)-time.Millisecond, 0)
		return idle, false, ackTimeout - idle + time.Millisecond
	}
	return 0, true, min(ackTimeout/2, rest-ackTimeout)
}

func floorMs(d time.Duration) time.Duration { return d.Truncate(time.Millisecond) }

func ceilMs(d time.Duration) time.Duration {
	if t := d.Truncate(time.Millisecond); t != d {
		return t + time.Millisecond
	}
	return d
}

func ms(d time.Duration) int64 { return int64(d / time.Millisecond) }

// parkHeap orders parked entries by next.
type parkHeap []*parked

func (h parkHeap) Len() int           { return len(h) }
func (h parkHeap) Less(i, j int) bool { return h[i].next.Before(h[j].next) }
func (h parkHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *parkHeap) Push(x any) {
	p := x.(*parked)
	p.index = len(*h)
	*h = append(*h, p)
}
func (h *parkHeap) Pop() any {
	old := *h
	p := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	p.index = -1
	return p
}

// unpark forgets p. The caller holds mu.
func (s *subscription) unpark(p *parked) {
	if p.heap != nil {
		heap.Remove(p.heap, p.index)
		p.heap = nil
	}
	if s.parked[p.id] == p {
		delete(s.parked, p.id)
	}
}

// queue puts p, which an XCLAIM returning at touchedAt gave idle time idle, in the heap of
// its next step, unless it was forgotten meanwhile.
func (s *subscription) queue(p *parked, touchedAt time.Time, idle time.Duration, refresh bool, wait time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.parked[p.id] != p {
		return
	}
	p.touchedAt, p.idle, p.next, p.refresh = touchedAt, idle, touchedAt.Add(wait), refresh
	s.push(p)
}

// push queues p in the heap of its next step. The caller holds mu.
func (s *subscription) push(p *parked) {
	p.heap = &s.claims
	if p.refresh {
		p.heap = &s.refreshes
	}
	heap.Push(p.heap, p)
	s.armPark(time.Time{})
}

// armPark sets parkTimer for the first parked entry whose idle time must be pushed back, or
// that is to be claimed back and not due yet (one that is due waits for the next Fetch, which
// the timer has hurried), or for retry when it is not zero. The caller holds mu.
func (s *subscription) armPark(retry time.Time) {
	at := retry
	now := time.Now()
	if len(s.refreshes) > 0 && (at.IsZero() || s.refreshes[0].next.Before(at)) {
		at = s.refreshes[0].next
	}
	if len(s.claims) > 0 && s.claims[0].next.After(now) && (at.IsZero() || s.claims[0].next.Before(at)) {
		at = s.claims[0].next
	}
	switch {
	case at.IsZero():
		if !s.parkAt.IsZero() {
			s.parkTimer.Stop()
			s.parkAt = time.Time{}
		}
	case s.parkAt.IsZero() || at.Before(s.parkAt):
		s.parkAt = at
		s.parkTimer.Reset(time.Until(at))
	}
}

// parkDue pushes back the idle time of the parked entries that need it, and hurries the
// engine to fetch when a parked entry is due to be claimed back; then it sets parkTimer for
// the next. A failed push back is tried again after a second (the reads notice a lost
// connection meanwhile).
func (s *subscription) parkDue() {
	now := time.Now()
	err := s.refreshParked(now)
	s.mu.Lock()
	s.parkAt = time.Time{}
	claim := len(s.claims) > 0 && !s.claims[0].next.After(now)
	var retry time.Time
	if err != nil {
		retry = now.Add(time.Second)
	}
	s.armPark(retry)
	s.mu.Unlock()
	if claim {
		s.sub.Hurry()
	}
}

// popDue takes out of h up to limit entries whose next step is due at now.
func (s *subscription) popDue(h *parkHeap, now time.Time, limit int) []*parked {
	s.mu.Lock()
	defer s.mu.Unlock()
	var due []*parked
	for len(*h) > 0 && len(due) < limit && !(*h)[0].next.After(now) {
		p := heap.Pop(h).(*parked)
		p.heap = nil
		due = append(due, p)
	}
	return due
}

// requeue puts back in their heaps the parked entries, still ours, that popDue took and a
// failed command did not handle, or that a claim found not idle long enough yet.
func (s *subscription) requeue(ps []*parked) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range ps {
		if s.parked[p.id] == p && p.heap == nil {
			s.push(p)
		}
	}
}

// forget drops parked entries that are no longer ours.
func (s *subscription) forget(ps ...*parked) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range ps {
		s.unpark(p)
	}
}

// touchArgs returns the XCLAIM that gives p, if it is still ours, idle time idle.
func (s *subscription) touchArgs(p *parked, now time.Time, idle time.Duration) []any {
	return []any{"XCLAIM", s.topic, s.group, s.consumer, ms(p.guard(now)), p.id, "IDLE", ms(idle), "JUSTID"}
}

// park gives the entry of a nacked delivery the idle time that makes it claimable when its
// delay ends, retrying while Redis cannot be reached and the entry is still ours.
func (s *subscription) park(p *parked) {
	for n := 1; ; n++ {
		now := time.Now()
		idle, refresh, wait := p.plan(now, s.cfg.AckTimeout)
		ids, err := s.client.Do(s.opCtx, s.touchArgs(p, now, idle)...).StringSlice()
		replied := time.Now()
		switch {
		case err == nil && len(ids) == 1:
			s.queue(p, replied, idle, refresh, wait)
			return
		case err == nil:
			// Another consumer claimed it after our ack deadline, or it was deleted.
			s.forget(p)
			return
		}
		if s.opCtx.Err() != nil || !isConnErr(err) || p.idle+time.Since(p.touchedAt) >= s.cfg.AckTimeout {
			// It stays pending as delivered: claimable AckTimeout after its delivery.
			s.cfg.log.Error(fmt.Sprintf("Could not delay the redelivery of nacked entry %s", p.id), err, s.fields)
			s.forget(p)
			return
		}
		inflight.Pause(s.opCtx.Done(), backoff(n))
	}
}

// refreshParked pushes back the idle time of the parked entries whose delay is longer than
// AckTimeout, when it is due.
func (s *subscription) refreshParked(now time.Time) error {
	due := s.popDue(&s.refreshes, now, 1000)
	if len(due) == 0 {
		return nil
	}
	type plan struct {
		idle    time.Duration
		refresh bool
		wait    time.Duration
		cmd     *redis.Cmd
	}
	plans := make([]plan, len(due))
	pipe := s.client.Pipeline()
	for i, p := range due {
		idle, refresh, wait := p.plan(now, s.cfg.AckTimeout)
		plans[i] = plan{idle: idle, refresh: refresh, wait: wait, cmd: pipe.Do(s.opCtx, s.touchArgs(p, now, idle)...)}
	}
	if _, err := pipe.Exec(s.opCtx); err != nil && isConnErr(err) {
		s.requeue(due)
		return fmt.Errorf("XCLAIM of delayed entries: %w", err)
	}
	replied := time.Now()
	for i, p := range due {
		ids, err := plans[i].cmd.StringSlice()
		if err == nil && len(ids) == 1 {
			s.queue(p, replied, plans[i].idle, plans[i].refresh, plans[i].wait)
		} else {
			s.forget(p)
		}
	}
	return nil
}

// claimParked claims back, as a new delivery, the parked entries whose delay has ended.
func (s *subscription) claimParked(due []*parked) error {
	ids := make([]string, len(due))
	for i, p := range due {
		ids[i] = p.id
	}
	sent := time.Now()
	msgs, err := s.client.XClaim(s.opCtx, &redis.XClaimArgs{
		Stream: s.topic, Group: s.group, Consumer: s.consumer,
		MinIdle: ceilMs(s.cfg.AckTimeout), Messages: ids,
	}).Result()
	if err != nil {
		if isConnErr(err) || redis.HasErrorPrefix(err, "NOGROUP") {
			s.requeue(due) // tried again once Redis answers, or the group is back
		} else {
			s.forget(due...)
		}
		return fmt.Errorf("XCLAIM of entries whose delay ended: %w", err)
	}
	replied := time.Now()
	got := make(map[string]bool, len(msgs))
	for _, m := range msgs {
		got[m.ID] = true
	}
	var missing []*parked
	for _, p := range due {
		if !got[p.id] {
			missing = append(missing, p)
		}
	}
	if err := s.deliverClaimed(msgs, sent, replied); err != nil {
		return err
	}
	if len(missing) > 0 {
		return s.recheck(missing)
	}
	return nil
}

// recheck looks at parked entries that a claim did not take: still ours and not idle long
// enough (the clocks disagree by a millisecond), they wait the rest; otherwise they are
// someone else's, settled or deleted.
func (s *subscription) recheck(ps []*parked) error {
	ids := make([]string, len(ps))
	for i, p := range ps {
		ids[i] = p.id
	}
	pending, err := s.pending(ids)
	if err != nil {
		s.forget(ps...) // they stay pending: a claim pass finds them
		return err
	}
	now := time.Now()
	var wait []*parked
	for i, p := range ps {
		xp := pending[i]
		if xp.ID == p.id && xp.Consumer == s.consumer && xp.Idle < s.cfg.AckTimeout {
			p.touchedAt, p.idle, p.refresh = now, xp.Idle, false
			p.next = now.Add(s.cfg.AckTimeout - xp.Idle + time.Millisecond)
			wait = append(wait, p)
			continue
		}
		s.forget(p)
	}
	s.requeue(wait)
	return nil
}
