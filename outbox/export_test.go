package outbox

// Kill stops the relay as a crash would: its transaction rolls back without committing the
// offsets of the batch.
func (r *Relay) Kill() { r.kill() }

// Polls returns how many polls of the outbox have ended.
func (r *Relay) Polls() int64 { return r.backoff.polls.Load() }

// Stopping is closed when Close begins.
func (r *Relay) Stopping() <-chan struct{} { return r.sub.stopping }
