package redis

import (
	"fmt"
	"time"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Acks are coalesced: the first ack of a batch waits ackLinger for others, then one XACK
// carries them all (at most maxAckBatch ids). Acks given while an XACK is on its way go in
// the next one. An ack leaves the window when it is given, so the wait never holds the
// window up.
const (
	ackLinger   = 2 * time.Millisecond
	maxAckBatch = 1000
)

// flushAcks sends the acks given, until flushStop is closed; then it sends what is left.
func (s *subscription) flushAcks() {
	defer close(s.flushDone)
	for {
		select {
		case <-s.ackReady:
		case <-s.flushStop:
			s.sendAcks()
			return
		}
		s.mu.Lock()
		full := len(s.acks) >= maxAckBatch
		s.mu.Unlock()
		if !full {
			inflight.Pause(s.flushStop, ackLinger)
		}
		s.sendAcks()
	}
}

// sendAcks sends every ack given so far, in batches of at most maxAckBatch, until opCtx
// ends; those left unsent then stay in acks.
func (s *subscription) sendAcks() {
	for {
		s.mu.Lock()
		k := min(len(s.acks), maxAckBatch)
		batch := s.acks[:k:k]
		s.acks = s.acks[k:]
		s.mu.Unlock()
		if len(batch) == 0 {
			return
		}
		if !s.xack(batch) {
			s.mu.Lock()
			s.acks = append(batch, s.acks...)
			s.mu.Unlock()
			return
		}
		s.mu.Lock()
		for _, id := range batch {
			delete(s.acking, id)
		}
		s.mu.Unlock()
	}
}

// xack acknowledges ids with one XACK, retrying while Redis cannot be reached. It reports
// false when opCtx ends first. An error other than a lost connection (the stream or the group
// was deleted) is logged, and the acks are dropped: the entries, if they still exist, are
// delivered again.
func (s *subscription) xack(ids []string) bool {
	for n := 1; ; n++ {
		err := s.client.XAck(s.opCtx, s.topic, s.group, ids...).Err()
		switch {
		case err == nil:
			return true
		case s.opCtx.Err() != nil:
			return false
		case !isConnErr(err):
			s.cfg.log.Error(fmt.Sprintf("XACK of %d entries refused; they will be delivered again", len(ids)), err, s.fields)
			return true
		}
		inflight.Pause(s.opCtx.Done(), backoff(n))
	}
}
