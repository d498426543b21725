package onceflow

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
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
	ins, off, ack, cf := middleware.DedupInsertFirst, middleware.DedupByOffset, middleware.DedupAckInTransaction, middleware.DedupCheckFirst
	for _, tc := range []struct {
		name     string
		h        Handler
		group    bool
		hasDedup bool
		mode     middleware.DedupMode
		keys     bool
	}{
		{"a transaction per message", Handler{QoS: ExactlyOnce, GroupCommit: GroupCommitConfig{Disabled: true}}, false, true, ins, true},
		{"group commit by default", Handler{QoS: ExactlyOnce}, true, true, ins, true},
		{"a batch processor", Handler{QoS: ExactlyOnce, BatchProcessor: batchNothing}, true, true, ins, true},
		{"at least once", Handler{QoS: AtLeastOnce, GroupCommit: GroupCommitConfig{}}, true, false, ins, false},
		{"by offset", Handler{QoS: ExactlyOnce, Dedup: middleware.Dedup{Mode: off}}, true, true, off, false},
		{"by offset per message", Handler{QoS: ExactlyOnce, Dedup: middleware.Dedup{Mode: off}, GroupCommit: GroupCommitConfig{Disabled: true}}, false, true, off, false},
		{"ack in the transaction", Handler{QoS: ExactlyOnce, Dedup: middleware.Dedup{Mode: ack}}, true, true, ack, false},
		{"check first keeps a transaction per message", Handler{QoS: ExactlyOnce, Dedup: middleware.Dedup{Mode: cf}}, false, true, cf, true},
		{"in order", Handler{QoS: ExactlyOnceInOrder}, true, true, ins, true},
		{"in order without deduplicate", Handler{Chain: ExactlyOnceInOrder.Chain().Remove(StageDeduplicate, AppliedTwice)}, true, false, ins, true},
		{"best effort", Handler{QoS: BestEffort}, true, false, ins, false},
		{"no transaction", Handler{Chain: AtLeastOnce.Chain().Remove(StageTransaction, PartlyApplied)}, false, false, ins, false},
		{"deduplicate replaced", Handler{Chain: eo.Replace(StageDeduplicate, Use("mine", pass)), GroupCommit: GroupCommitConfig{}}, true, false, ins, false},
		{"transaction replaced", Handler{Chain: eo.Replace(StageTransaction, Use("mine", pass)), GroupCommit: GroupCommitConfig{}}, false, true, ins, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := planOf(tc.h)
			require.Equal(t, tc.group, p.group, "group")
			require.Equal(t, tc.hasDedup, p.hasDedup, "has deduplicate")
			require.Equal(t, tc.mode, p.dedup, "dedup mode")
			require.Equal(t, tc.keys, p.recordsKeys, "records keys")
		})
	}
}
