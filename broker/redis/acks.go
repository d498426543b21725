package redis

import (
	"context"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Acks are coalesced: the first ack of a batch waits ackLinger for others, then one XACK
// carries them all (at most maxAckBatch ids); acks given meanwhile go in the next one. An ack
// leaves the window when it is given, so the wait never holds the window up.
const (
	ackLinger   = 2 * time.Millisecond
	maxAckBatch = 1000
)

// newAcks returns the writer of the subscription's acks, which sends them until opCtx ends.
func (s *subscription) newAcks() *inflight.Writer[string] {
	return inflight.NewWriter(s.opCtx, inflight.WriterOptions[string]{
		Linger: ackLinger,
		Max:    maxAckBatch,
		Write:  s.xack,
		Wait:   func(_ error, n int, _ bool) time.Duration { return backoff(n) },
	})
}

// xack acknowledges ids with one XACK; it fails while Redis cannot be reached. An error other
// than a lost connection (the stream or the group was deleted) is logged, and the acks are
// dropped: the entries, if they still exist, are delivered again.
func (s *subscription) xack(ctx context.Context, ids []string) (int, error) {
	err := s.client.XAck(ctx, s.topic, s.group, ids...).Err()
	if err != nil && (ctx.Err() != nil || isConnErr(err)) {
		return 0, err
	}
	if err != nil {
		s.cfg.log.Error(fmt.Sprintf("XACK of %d entries refused; they will be delivered again", len(ids)), err, s.fields)
	}
	s.mu.Lock()
	for _, id := range ids {
		delete(s.acking, id)
	}
	s.mu.Unlock()
	return len(ids), nil
}
