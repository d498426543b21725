package onceflowtest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
)

// A message applied twice by a chain without duplicate detection, whose failed attempt was
// rolled back but whose next delivery died after its commit, is blamed on the missing
// duplicate detection, not on a write outside the transaction: the delivery that died after
// the commit applied it, as the acknowledged one did.
func TestExplain_ADeliveryThatDiedAfterItsCommitCountsAsApplied(t *testing.T) {
	killed := &proc{consumer: 1, n: 2, end: endKilled + " at 2.18s"}
	afterCommit := &proc{consumer: 0, n: 3, crash: &crash{Point: AfterCommit, N: 2}, crashed: true,
		end: "died at crash point after-commit at 1.43s"}
	last := &proc{consumer: 1, n: 8, end: endStopped}
	r := &runner{
		info: handlerInfo{qos: onceflow.ExactlyOnce, chain: onceflow.ExactlyOnce.Chain()},
		pool: &pool{events: map[string][]event{"m": {
			{at: 1260 * time.Millisecond, proc: killed, what: "received"},
			{at: 1270 * time.Millisecond, proc: killed, what: "injected panic"},
			{at: 1370 * time.Millisecond, proc: afterCommit, what: "received"},
			{at: 6390 * time.Millisecond, proc: last, what: "received"},
			{at: 6460 * time.Millisecond, proc: last, what: "acked"},
		}}},
	}
	_, cause := r.explain("m", "applied 2 times", 2)
	require.Contains(t, cause, "the chain detects no duplicates")

	// Without the delivery that died after its commit, the second effect outlived the
	// rolled-back attempt: a write outside the transaction.
	r.pool.events["m"] = append(r.pool.events["m"][:2], r.pool.events["m"][3:]...)
	killed.end = "exited (exit status 1) at 2.18s"
	_, cause = r.explain("m", "applied 2 times", 2)
	require.Contains(t, cause, "writes outside the handler's transaction")
}
