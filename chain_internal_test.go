package onceflow

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// pass is a middleware that does nothing.
func pass(next processor.Processor) processor.Processor { return next }

func TestRejectChain_ObservesAndDeadLettersOnly(t *testing.T) {
	require.Equal(t, []StageName{"tracing", "metrics", "deadletter"}, rejectChain(ExactlyOnce.Chain()).Names())
	require.Equal(t, []StageName{"tracing", "metrics", "deadletter"}, rejectChain(BestEffort.Chain()).Names(),
		"a message that cannot be converted is dead-lettered whatever the chain")
	audit := Use("audit", pass)
	edited := ExactlyOnce.Chain().Remove(StageTracing).Before(StageRetry, audit)
	require.Equal(t, []StageName{"metrics", "deadletter"}, rejectChain(edited).Names())
}

// Which implementation each built-in stage takes is decided by the Handler's configuration, so
// that an edit made relative to the stage's name holds whatever the configuration says.
func TestPlanOf_TheHandlersConfigurationChoosesTheImplementations(t *testing.T) {
	eo := ExactlyOnce.Chain()
	batchNothing := processor.BatchFunc(func(context.Context, []*messagedata.MessageData) error { return nil })
	for _, tc := range []struct {
		name  string
		h     Handler
		group bool
		dedup dedupMode
		keys  bool
	}{
		{"a transaction per message", Handler{QoS: ExactlyOnce}, false, dedupByID, true},
		{"group commit", Handler{QoS: ExactlyOnce, GroupCommit: GroupCommitConfig{Enabled: true}}, true, dedupByID, true},
		{"a batch processor", Handler{QoS: ExactlyOnce, BatchProcessor: batchNothing}, true, dedupByID, true},
		{"at least once", Handler{QoS: AtLeastOnce, GroupCommit: GroupCommitConfig{Enabled: true}}, true, dedupNone, false},
		{"by offset", Handler{QoS: ExactlyOnce, Dedup: DedupConfig{ByOffset: true}}, false, dedupByOffset, false},
		{"ack in the transaction", Handler{QoS: ExactlyOnce, Dedup: DedupConfig{AckInTransaction: true}}, false, dedupAckInTx, false},
		{"check first", Handler{QoS: ExactlyOnce, Dedup: DedupConfig{CheckFirst: true}}, false, dedupCheckFirst, true},
		{"in order", Handler{QoS: ExactlyOnceInOrder}, false, dedupByID, true},
		{"in order without deduplicate", Handler{Chain: ExactlyOnceInOrder.Chain().Remove(StageDeduplicate, AppliedTwice)}, false, dedupNone, true},
		{"deduplicate replaced", Handler{Chain: eo.Replace(StageDeduplicate, Use("mine", pass)), GroupCommit: GroupCommitConfig{Enabled: true}}, true, dedupNone, false},
		{"transaction replaced", Handler{Chain: eo.Replace(StageTransaction, Use("mine", pass)), GroupCommit: GroupCommitConfig{Enabled: true}}, false, dedupByID, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := planOf(tc.h)
			require.Equal(t, tc.group, p.group, "group")
			require.Equal(t, tc.dedup, p.dedup, "dedup")
			require.Equal(t, tc.keys, p.recordsKeys, "records keys")
		})
	}
}
