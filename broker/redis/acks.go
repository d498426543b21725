package redis

import (
	"time"
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
			t := time.NewTimer(ackLinger)
			select {
			case <-t.C:
			case <-s.flushStop:
			}
			t.Stop()
		}
		s.sendAcks()
	}
}

// sendAcks sends every ack given so far, retrying while Redis cannot be reached, until
// opCtx ends. Acks that an error other than a lost connection refuses (the stream or group
// was deleted) are dropped; those left unsent at the end of opCtx stay in acks.
func (s *subscription) sendAcks() {
	for n := 0; ; {
		s.mu.Lock()
		k := min(len(s.acks), maxAckBatch)
		batch := s.acks[:k:k]
		s.acks = s.acks[k:]
		s.mu.Unlock()
		if len(batch) == 0 {
			return
		}
		for {
			err := s.client.XAck(s.opCtx, s.topic, s.group, batch...).Err()
			if err == nil || !isConnErr(err) || s.opCtx.Err() != nil {
				if err != nil && s.opCtx.Err() != nil {
					s.mu.Lock()
					s.acks = append(batch, s.acks...)
					s.mu.Unlock()
					return
				}
				if err != nil {
					s.cfg.Logger.Error("XACK refused; those entries will be delivered again", err, s.fields)
				}
				break
			}
			n++
			t := time.NewTimer(backoff(n))
			select {
			case <-t.C:
			case <-s.opCtx.Done():
			}
			t.Stop()
		}
		n = 0
		s.mu.Lock()
		for _, id := range batch {
			delete(s.acking, id)
		}
		s.mu.Unlock()
	}
}
