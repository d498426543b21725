package outbox

import "context"

// Kill stops the relay as a crash would: the message being published is not recorded as
// sent, whatever the destination answers.
func (r *Relay) Kill() { r.kill() }

// Stopping is closed when the relay begins to stop.
func (r *Relay) Stopping() <-chan struct{} { return r.stopping }

// PurgeNow runs one purge round as the relay's timer does, and reports whether it ran (no
// other process held the purge lock).
func (r *Relay) PurgeNow(ctx context.Context) bool { return r.purgeOnce(ctx) }

// PurgeLock takes the outbox's purge lock without waiting.
func (o *Outbox) PurgeLock(ctx context.Context) (unlock func(), held bool, err error) {
	return o.d.purgeLock(ctx, o.db)
}
