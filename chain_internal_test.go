package onceflow

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
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

// middleware's canonical chains, for programs that compose their own, run their stages in the
// order of the router's chain of the same quality of service.
func TestMiddlewareChains_RunInTheOrderOfTheRoutersChains(t *testing.T) {
	levels := map[QoS]func(middleware.Stages) (middleware.Middleware, error){
		AtLeastOnce: middleware.AtLeastOnce, ExactlyOnce: middleware.ExactlyOnce, ExactlyOnceInOrder: middleware.ExactlyOnceInOrder,
	}
	for q, level := range levels {
		var ran []string
		record := func(name string) middleware.Middleware {
			return func(next processor.Processor) processor.Processor {
				return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					ran = append(ran, name)
					return next.Process(ctx, msg)
				})
			}
		}
		var s middleware.Stages
		stage := map[string]*middleware.Middleware{
			InterceptorTracing: &s.Tracing, InterceptorMetrics: &s.Metrics, InterceptorDeadLetter: &s.DeadLetter,
			InterceptorRecover: &s.Recover, InterceptorRetry: &s.Retry, InterceptorTimeout: &s.Timeout,
			InterceptorTransaction: &s.Transaction, InterceptorDeduplicate: &s.Deduplicate, InterceptorInOrder: &s.InOrder,
		}
		names := chainFor(q, false)
		for _, n := range names {
			require.Contains(t, stage, n, "%s: no stage for %q", q, n)
			*stage[n] = record(n)
		}
		chain, err := level(s)
		require.NoError(t, err, q)
		require.NoError(t, chain(processor.Func(func(context.Context, *messagedata.MessageData) error { return nil })).
			Process(context.Background(), &messagedata.MessageData{ID: "m"}))
		require.Equal(t, names, ran, q)
	}
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
		names := chainNames(tc.h)
		require.Equal(t, tc.want, names)
		require.NoError(t, checkOrder(names))
	}
	require.Error(t, checkOrder([]string{"group-commit", "ack-in-transaction"}), "a dedup row and the acknowledgement in the transaction")
	require.Error(t, checkOrder([]string{"group-offsets", "offsets"}))
	require.Error(t, checkOrder([]string{"ack-in-transaction", "group-transaction"}), "outside the transaction")
}
