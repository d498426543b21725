package outbox

import (
	"context"
	"time"
)

// purgeLoop purges the outbox every PurgeInterval, in the turn of one process at a time (a
// lock that is tried, not waited for: a relay that finds it taken skips the round), until
// ctx ends.
func (r *Relay) purgeLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.PurgeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.purgeOnce(ctx)
	}
}

// purgeOnce runs one purge, if no other process is purging the outbox, and reports whether it
// ran.
func (r *Relay) purgeOnce(ctx context.Context) bool {
	unlock, held, err := r.ob.d.purgeLock(ctx, r.cfg.DB)
	if err != nil {
		if ctx.Err() == nil {
			r.logger.Warn("outbox relay: cannot take the purge lock; purging later", "error", err)
		}
		return false
	}
	if !held {
		r.logger.Debug("outbox relay: another process is purging the outbox")
		return false
	}
	defer unlock()
	began := time.Now()
	res, err := r.ob.Purge(ctx, PurgeOptions{BatchSize: r.cfg.PurgeBatchSize})
	if err != nil && ctx.Err() == nil {
		r.logger.Warn("outbox relay: purge failed; purging again at the next interval", "error", err, "deleted", res.Deleted)
	}
	if res.Deleted > 0 {
		r.logger.Debug("outbox relay: purged relayed messages", "deleted", res.Deleted, "batches", res.Batches, "took", time.Since(began))
	}
	return true
}
