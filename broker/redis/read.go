package redis

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// This file reads a subscription's entries from the stream (XREADGROUP), as the window has
// room, registers them as deliveries and hands them out in order.

// fillWait bounds how long room in the window waits to grow to readRoom before new entries
// are read anyway. A variable for the tests only.
var fillWait = 20 * time.Millisecond

// readRoom returns the room in the window from which a read of new or idle entries is sent at
// once: half the window.
func (s *subscription) readRoom() int { return max(1, (s.cfg.Prefetch+1)/2) }

// roomLeft returns how many more deliveries the window takes.
func (s *subscription) roomLeft() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return max(s.cfg.Prefetch-len(s.inflight), 0)
}

// waitForRoom waits until a delivery leaves the window, a parked entry needs its idle time
// pushed back or is due to be claimed back, until (unless zero), or the subscription stops.
func (s *subscription) waitForRoom(until time.Time) {
	s.mu.Lock()
	var next <-chan time.Time
	at := until
	for _, h := range []parkHeap{s.claims, s.refreshes} {
		if len(h) > 0 && (at.IsZero() || h[0].next.Before(at)) {
			at = h[0].next
		}
	}
	if !at.IsZero() {
		t := time.NewTimer(time.Until(at))
		defer t.Stop()
		next = t.C
	}
	s.mu.Unlock()
	select {
	case <-s.room:
	case <-s.wake:
	case <-next:
	case <-s.stopping:
	}
}

// blockTime returns how long the next XREADGROUP may wait: BlockTime, or less when a claim
// is due sooner.
func (s *subscription) blockTime(now time.Time) time.Duration {
	block := min(s.cfg.BlockTime, s.pass.due().Sub(now))
	s.mu.Lock()
	for _, h := range []parkHeap{s.claims, s.refreshes} {
		if len(h) > 0 {
			block = min(block, h[0].next.Sub(now))
		}
	}
	s.mu.Unlock()
	return max(block, time.Millisecond) // BLOCK 0 would wait for ever
}

// reader returns what the XREADGROUPs are sent on: a connection of their own, whose blocked
// read stop can end at once, or else the client.
func (s *subscription) reader() (redis.Cmdable, error) {
	if s.readConn != nil {
		return s.readConn, nil
	}
	c, ok := s.client.(interface {
		Conn() *redis.Conn
		Options() *redis.Options
	})
	if !ok {
		return s.client, nil
	}
	// A connection of its own is one of the pool's for good: leave the pool at least half.
	if s.owner.readConns.Add(1) > int32(c.Options().PoolSize/2) {
		s.owner.readConns.Add(-1)
		return s.client, nil
	}
	conn := c.Conn()
	id, err := conn.ClientID(s.opCtx).Result()
	if err != nil {
		_ = conn.Close()
		s.owner.readConns.Add(-1)
		return nil, fmt.Errorf("CLIENT ID: %w", err)
	}
	s.readConn = conn
	s.readID.Store(id)
	return conn, nil
}

// dropReader closes the connection of the reads; the next read opens another.
func (s *subscription) dropReader() {
	if s.readConn != nil {
		s.readID.Store(0)
		_ = s.readConn.Close()
		s.readConn = nil
		s.owner.readConns.Add(-1)
	}
}

// unblockReads ends the XREADGROUP that run waits for, until run is done or deadline
// passes. Without CLIENT UNBLOCK (another client, or an ACL that forbids it), run notices the
// stop within BlockTime.
func (s *subscription) unblockReads(deadline time.Time) {
	for time.Now().Before(deadline) {
		if id := s.readID.Load(); id != 0 {
			ctx, cancel := context.WithDeadline(s.opCtx, deadline)
			err := s.client.ClientUnblock(ctx, id).Err()
			cancel()
			if err != nil && !isConnErr(err) {
				return
			}
		}
		t := time.NewTimer(10 * time.Millisecond)
		select {
		case <-s.loopDone:
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// read delivers up to room new entries of the stream.
func (s *subscription) read(room int, block time.Duration) error {
	r, err := s.reader()
	if err != nil {
		return err
	}
	if s.isStopping() {
		return nil
	}
	sent := time.Now()
	streams, err := r.XReadGroup(s.opCtx, &redis.XReadGroupArgs{
		Group:    s.group,
		Consumer: s.consumer,
		Streams:  []string{s.topic, ">"},
		Count:    int64(room),
		Block:    block,
	}).Result()
	if errors.Is(err, redis.Nil) {
		return nil
	}
	if err != nil {
		s.dropReader()
		return fmt.Errorf("XREADGROUP: %w", err)
	}
	replied := time.Now()
	var batch []entry
	for _, st := range streams {
		for _, m := range st.Messages {
			batch = append(batch, entry{msg: m, count: 1}) // first delivery to the group
		}
	}
	s.deliver(batch, sent, replied)
	return nil
}

// entry is a stream entry that is ours to deliver, with its delivery count.
type entry struct {
	msg   redis.XMessage
	count int
}

// deliver registers the entries as deliveries and hands them to the pump. sent is when the
// command that made them ours was sent: no other consumer can claim them before sent plus
// AckTimeout, when their contexts are cancelled.
func (s *subscription) deliver(entries []entry, sent, replied time.Time) {
	batch := s.register(entries, sent, replied)
	if len(batch) == 0 {
		return
	}
	select {
	case s.handout <- batch:
	case <-s.stopping:
		// Registered: stop gives them back.
	}
}

func (s *subscription) register(entries []entry, sent, replied time.Time) []*delivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped || len(entries) == 0 {
		return nil
	}
	batch := make([]*delivery, 0, len(entries))
	for _, e := range entries {
		id := e.msg.ID
		if p := s.parked[id]; p != nil {
			s.unpark(p)
		}
		if _, ok := s.acking[id]; ok {
			// Claimed again while its XACK waits for a connection: the ack settles it.
			continue
		}
		if old := s.inflight[id]; old != nil {
			old.superseded = true // its ack deadline has passed; it is delivered anew
			if s.direct {
				s.leave(old, false, false)
				s.afterLeave(old, nil, false)
			} else {
				old.cancel()
			}
		}
		msg, _ := Marshaller{}.Unmarshal(e.msg.Values) // never fails
		d := &delivery{id: id, msg: msg, replied: replied}
		s.inflight[id] = d
		batch = append(batch, d)
		if s.direct {
			var ctx context.Context
			ctx, d.cancel = context.WithCancel(s.base)
			msg.SetContext(redelivery.NewDeliveryContext(ctx, infoOf(e.count), func() { s.settled(d) }, s.flush))
			d.ctx = msg.Context()
			s.hold(d, sent.Add(s.cfg.AckTimeout))
			continue
		}
		ctx, cancel := context.WithDeadline(s.ctx, sent.Add(s.cfg.AckTimeout))
		ctx = redelivery.NewContext(ctx, infoOf(e.count))
		msg.SetContext(ctx)
		d.ctx, d.cancel, d.classified = ctx, cancel, make(chan struct{})
		s.watchers.Add(1)
		go s.watch(d)
	}
	return batch
}

// pump hands the registered deliveries out, in order, until the subscription stops. stop
// closes out once it is done, so that a consumer that sees the channel closed knows the acks
// it gave are in Redis.
func (s *subscription) pump() {
	defer close(s.pumpDone)
	for {
		select {
		case <-s.stopping:
			return
		case batch := <-s.handout:
			for _, d := range batch {
				if d.ctx.Err() != nil || s.isStopping() {
					continue // ended before the consumer took it: its goroutine settles it
				}
				select {
				case s.out <- d.msg:
				case <-s.stopping:
					return
				}
			}
		}
	}
}
