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

func TestRejectChain_ObservesAndDeadLettersOnly(t *testing.T) {
	require.Equal(t, []string{"tracing", "metrics", "deadletter"}, rejectChain(chainFor(ExactlyOnce, false)))
	require.Equal(t, []string{"tracing", "metrics", "deadletter"}, rejectChain(chainFor(BestEffort, true)))
	require.Equal(t, []string{"metrics", "deadletter"}, rejectChain([]string{"metrics", "retry", "transaction", "audit"}))
}
