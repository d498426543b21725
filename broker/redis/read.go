package redis

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// This file reads a subscription's new entries from the stream (XREADGROUP) and delivers them.

// fillWait bounds how long room in the window waits to grow to half the window before new
// entries are read anyway.
const fillWait = 20 * time.Millisecond

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
	s.readMu.Lock()
	defer s.readMu.Unlock()
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
	s.readMu.Lock()
	defer s.readMu.Unlock()
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
		if !inflight.Pause(s.closed, 10*time.Millisecond) {
			return
		}
	}
}

// read delivers up to room new entries of the stream.
func (s *subscription) read(room int, block time.Duration) error {
	r, err := s.reader()
	if err != nil {
		return err
	}
	if s.sub.Stopped() {
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

// deliver makes the entries deliveries. sent is when the command that made them ours was
// sent: no other consumer can claim them before sent plus AckTimeout, when their deliveries
// end. Entries that the subscription refuses as it ends stay pending: the end gives them back.
func (s *subscription) deliver(entries []entry, sent, replied time.Time) {
	s.mu.Lock()
	var superseded []*inflight.Delivery[entryRef]
	for _, e := range entries {
		if old := s.inflight[e.msg.ID]; old != nil {
			superseded = append(superseded, old)
		}
	}
	s.mu.Unlock()
	for _, old := range superseded {
		// Its ack deadline has passed at the server; it is delivered anew.
		s.sub.End(errSuperseded, func(d *inflight.Delivery[entryRef]) bool { return d == old })
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	deadline := sent.Add(s.cfg.AckTimeout)
	for _, e := range entries {
		id := e.msg.ID
		if p := s.parked[id]; p != nil {
			s.unpark(p)
		}
		if _, ok := s.acking[id]; ok {
			// Claimed again while its XACK waits for a connection: the ack settles it.
			continue
		}
		msg, _ := Marshaller{}.Unmarshal(e.msg.Values) // never fails
		d := s.sub.Emit(inflight.Item[entryRef]{Data: entryRef{id: id, replied: replied}, Msg: msg, Count: e.count, Deadline: deadline})
		if d == nil {
			return
		}
		s.inflight[id] = d
	}
}
