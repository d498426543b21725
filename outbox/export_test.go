package outbox

// Kill stops the relay as a crash would: the message being published is not recorded as
// sent, whatever the destination answers.
func (r *Relay) Kill() { r.kill() }

// Stopping is closed when the relay begins to stop.
func (r *Relay) Stopping() <-chan struct{} { return r.stopping }
