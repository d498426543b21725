package onceflow

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestChainFor_GroupCommitTakesThePlaceOfTransactionAndDeduplicate(t *testing.T) {
	require.Equal(t, []string{"tracing", "metrics", "deadletter", "recover", "retry", "timeout", "group-commit"},
		chainFor(ExactlyOnce, true))
	require.Equal(t, []string{"tracing", "metrics", "deadletter", "recover", "retry", "timeout", "group-transaction"},
		chainFor(AtLeastOnce, true))
	require.Equal(t, []string{"tracing", "metrics", "recover", "timeout", "group-transaction"},
		chainFor(BestEffort, true))
	require.Equal(t, []string{"tracing", "metrics", "deadletter", "recover", "retry", "timeout", "group-commit", "in-order"},
		chainFor(ExactlyOnceInOrder, true))
	require.Equal(t, qosChain(ExactlyOnce), chainFor(ExactlyOnce, false))
	for _, q := range []QoS{BestEffort, AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder} {
		require.NoError(t, checkOrder(chainFor(q, true)), q)
	}
}

func TestRecordsKeys_GroupCommitRecordsKeysGroupTransactionDoesNot(t *testing.T) {
	require.True(t, recordsKeys([]string{"retry", "group-commit"}))
	require.False(t, recordsKeys([]string{"retry", "group-transaction"}))
}

// With group commit, duplicate detection by offset runs the group's transaction itself
// ("group-offsets"), and the acknowledgement in the transaction runs inside a group's
// transaction without a dedup row, member by member.
func TestInterceptorNames_GroupCommitWithOffsetsOrAckInTransaction(t *testing.T) {
	outer := []string{"tracing", "metrics", "deadletter", "recover", "retry", "timeout"}
	for _, tc := range []struct {
		h    Handler
		want []string
	}{
		{Handler{QoS: ExactlyOnce, Dedup: DedupConfig{ByOffset: true}}, append(outer[:6:6], "transaction", "offsets")},
		{Handler{QoS: ExactlyOnce, Dedup: DedupConfig{ByOffset: true}, GroupCommit: GroupCommitConfig{Enabled: true}}, append(outer[:6:6], "group-offsets")},
		{Handler{QoS: ExactlyOnce, Dedup: DedupConfig{AckInTransaction: true}}, append(outer[:6:6], "transaction", "ack-in-transaction")},
		{Handler{QoS: ExactlyOnce, Dedup: DedupConfig{AckInTransaction: true}, GroupCommit: GroupCommitConfig{Enabled: true}},
			append(outer[:6:6], "group-transaction", "ack-in-transaction")},
	} {
		names := tc.h.interceptorNames()
		require.Equal(t, tc.want, names)
		require.NoError(t, checkOrder(names))
	}
	require.Error(t, checkOrder([]string{"group-commit", "ack-in-transaction"}), "a dedup row and the acknowledgement in the transaction")
	require.Error(t, checkOrder([]string{"group-offsets", "offsets"}))
	require.Error(t, checkOrder([]string{"ack-in-transaction", "group-transaction"}), "outside the transaction")
}
