package kafka

import (
	"context"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// This file handles the partitions a subscription loses, revoked (revoked) or lost (lost).

// release gives up the partitions ids (all when ids is nil): with commit, it commits what is
// acked of them first; then it takes them out of the books, gives back the places of the
// window their records held, and ends their deliveries in flight (ErrRevoked): their next
// owner delivers their records again.
func (sub *subscription) release(ctx context.Context, ids []int32, commit bool) error {
	sub.commitMu.Lock()
	var err error
	if commit {
		err = sub.commitLocked(ctx, ids, true)
	}
	sub.mu.Lock()
	var dropped []*partition
	for _, p := range sub.partsLocked(ids) {
		p.gone = true
		sub.sub.Release(p.kept)
		p.kept = 0
		p.entries, p.pending, p.held = nil, nil, nil
		delete(sub.parts, p.id)
		dropped = append(dropped, p)
	}
	if sub.gated {
		sub.pumpLocked()
	}
	sub.mu.Unlock()
	sub.commitMu.Unlock()
	if len(dropped) > 0 {
		// The engine tells Settle: sub.mu is not held.
		sub.sub.End(ErrRevoked, func(d *inflight.Delivery[*delivery]) bool { return slices.Contains(dropped, d.Data.p) })
	}
	return err
}

// revoked is kgo's OnPartitionsRevoked: the group takes partitions away (a rebalance, or the
// member leaving). It does what the package documentation's Rebalances says.
func (sub *subscription) revoked(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	ids := lost[sub.topic]
	if len(ids) == 0 {
		return
	}
	var drained []chan struct{}
	sub.mu.Lock()
	revoking := sub.partsLocked(ids)
	for _, p := range revoking {
		p.revoking = true
		if p.live > 0 {
			p.drained = make(chan struct{})
			drained = append(drained, p.drained)
		}
	}
	sub.mu.Unlock()
	// What the consumer has not taken yet is not handed out: the wait is for what it has.
	sub.sub.Withdraw(ErrRevoked, func(d *inflight.Delivery[*delivery]) bool { return slices.Contains(revoking, d.Data.p) })
	// Until RevokeTimeout passes, or the subscription ends: its deliveries end with it.
	wait, cancel := context.WithTimeout(sub.sub.Context(), sub.s.cfg.RevokeTimeout)
	for _, ch := range drained {
		inflight.Wait(wait, ch)
	}
	cancel()

	ctx, cancel := context.WithTimeout(context.Background(), sub.s.cfg.CloseTimeout)
	defer cancel()
	if err := sub.release(ctx, ids, true); err != nil {
		sub.logger.Error("Cannot commit the offsets of revoked partitions: their new owner delivers the acked records again", err, watermill.LogFields{"partitions": ids})
	}
}

// lost is kgo's OnPartitionsLost: the member lost its partitions without a revoke (its
// session expired); a commit would be refused. The books of those partitions are dropped.
func (sub *subscription) lost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	if ids := lost[sub.topic]; len(ids) > 0 {
		_ = sub.release(context.Background(), ids, false)
		sub.logger.Info("Partitions lost: their records are delivered again by their next owner", watermill.LogFields{"partitions": ids})
	}
}
