package kafka

import (
	"context"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// This file handles the partitions a subscription loses: revoked ones stop handing out and
// commit what is acked before their books are dropped; lost ones are dropped at once.

// dropLocked takes parts out of the books, gives back the places of the window their records
// held, and returns those it dropped; the caller then ends their deliveries (drop). sub.mu is
// held.
func (sub *subscription) dropLocked(parts []*partition) []*partition {
	var dropped []*partition
	for _, p := range parts {
		if p.gone {
			continue
		}
		p.gone = true
		sub.sub.Release(p.kept)
		p.kept = 0
		sub.gate.acked(-(p.acks - p.ackCommitted))
		p.ackCommitted = p.acks
		p.entries, p.pending, p.held = nil, nil, nil
		delete(sub.parts, p.id)
		dropped = append(dropped, p)
	}
	return dropped
}

// end ends the deliveries in flight of the partitions dropped (ErrRevoked): their new owner
// delivers their records again. sub.mu is not held: the engine tells Settle.
func (sub *subscription) end(dropped []*partition) {
	if len(dropped) > 0 {
		sub.sub.End(ErrRevoked, func(d *inflight.Delivery[*delivery]) bool { return slices.Contains(dropped, d.Data.p) })
	}
}

// revoked is kgo's OnPartitionsRevoked: the group takes partitions away (a rebalance, or the
// member leaving). It stops handing out their records (it withdraws those its consumer has not
// taken yet), waits up to Config.RevokeTimeout for the deliveries the consumer has to settle,
// commits what is acked and drops the rest from the books, for their new owner to deliver
// again.
func (sub *subscription) revoked(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	ids := lost[sub.topic]
	if len(ids) == 0 {
		return
	}
	var (
		revoking []*partition
		drained  []chan struct{}
	)
	sub.mu.Lock()
	for _, id := range ids {
		p := sub.parts[id]
		if p == nil || p.gone {
			continue
		}
		p.revoking = true
		revoking = append(revoking, p)
		if len(p.live) > 0 {
			if p.drained == nil {
				p.drained = make(chan struct{})
			}
			drained = append(drained, p.drained)
		}
	}
	sub.mu.Unlock()
	// What the consumer has not taken yet is not handed out: the wait is for what it has.
	sub.sub.Withdraw(ErrRevoked, func(d *inflight.Delivery[*delivery]) bool { return slices.Contains(revoking, d.Data.p) })
	wait := time.NewTimer(sub.s.cfg.RevokeTimeout)
	defer wait.Stop()
waiting:
	for _, ch := range drained {
		select {
		case <-ch:
		case <-wait.C:
			break waiting
		case <-sub.ctx.Done():
			break waiting // the subscription ends: its deliveries end with it
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), sub.s.cfg.CloseTimeout)
	defer cancel()
	dropped, err := sub.commitMarks(ctx, ids, true)
	if err != nil {
		sub.logger.Error("Cannot commit the offsets of revoked partitions: their new owner delivers the acked records again", err, watermill.LogFields{"partitions": ids})
	}
	sub.end(dropped)
}

// lost is kgo's OnPartitionsLost: the member lost its partitions without a revoke (its
// session expired); a commit would be refused. The books of those partitions are dropped.
func (sub *subscription) lost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	ids := lost[sub.topic]
	if len(ids) == 0 {
		return
	}
	sub.commitMu.Lock()
	sub.mu.Lock()
	var parts []*partition
	for _, id := range ids {
		if p := sub.parts[id]; p != nil {
			parts = append(parts, p)
		}
	}
	dropped := sub.dropLocked(parts)
	sub.mu.Unlock()
	sub.commitMu.Unlock()
	sub.end(dropped)
	sub.logger.Info("Partitions lost: their records are delivered again by their next owner", watermill.LogFields{"partitions": ids})
}
