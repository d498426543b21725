// Package crashpoint marks the moments in a message's processing at which a fault-injection run
// (package onceflowtest, and onceflow verify through it) kills its consumer process, to
// exercise each crash window of the guarantee model: after the delivery is received, before
// the handler's transaction commits, after the outcome is known and before the acknowledgement,
// and between a dead letter's publish and its record.
//
// The router and the middlewares call Reach at those moments; a consumer process of a run sets
// the one hook (Set) that counts them and kills the process at the armed one. Anywhere else
// no hook is set, and Reach costs one atomic load. It is internal, not a knob of Handler: it
// exists to kill the process, which no program wants in production.
package crashpoint

import "sync/atomic"

// Point is a moment in a message's processing.
type Point uint8

// The points, in the order a message meets them.
const (
	// Received: the router has the delivery, converted; nothing is written. A BestEffort
	// handler has acknowledged it already.
	Received Point = iota + 1
	// BeforeCommit: the chain inside the handler's transaction returned and the transaction
	// is about to commit: per message (middleware.Transaction) or per group (group commit, a
	// batch processor), once for each message the group commits.
	BeforeCommit
	// AfterCommit: the chain's outcome acknowledges the message (it committed, was a
	// duplicate, or was dead-lettered) and the acknowledgement is not sent yet.
	AfterCommit
	// DeadLettered: the message's dead letter is published, and neither recorded
	// (middleware.WithDeadLetterRecord) nor acknowledged.
	DeadLettered
)

// Hook is called at each point with the id of the message there.
type Hook func(p Point, id string)

var hook atomic.Pointer[Hook]

// Set makes h the hook of this process; nil removes it.
func Set(h Hook) {
	if h == nil {
		hook.Store(nil)
		return
	}
	hook.Store(&h)
}

// Armed reports whether a hook is set: a caller whose id costs something to compute asks
// first.
func Armed() bool { return hook.Load() != nil }

// Reach calls the hook, if one is set, for the message with id at p.
func Reach(p Point, id string) {
	if h := hook.Load(); h != nil {
		(*h)(p, id)
	}
}
