package onceflow_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// pass is a middleware that does nothing.
func pass(next processor.Processor) processor.Processor { return next }

func TestQoSChain_PrintsTheCanonicalChainsInTheOrderTheyRun(t *testing.T) {
	for q, want := range map[onceflow.QoS]string{
		onceflow.BestEffort:         "tracing -> metrics -> recover -> timeout -> transaction",
		onceflow.AtLeastOnce:        "tracing -> metrics -> deadletter -> recover -> retry -> timeout -> transaction",
		onceflow.ExactlyOnce:        "tracing -> metrics -> deadletter -> recover -> retry -> timeout -> transaction -> deduplicate",
		onceflow.ExactlyOnceInOrder: "tracing -> metrics -> deadletter -> recover -> retry -> timeout -> transaction -> deduplicate -> in-order",
	} {
		require.Equal(t, want, q.Chain().String(), q)
		require.Equal(t, q, q.Chain().QoS())
		require.NoError(t, q.Chain().Err())
	}
	require.ErrorContains(t, onceflow.QoS(0).Chain().Err(), "QoS(0) is not a quality of service")
}

func TestChain_EditsReturnANewChainAndLeaveTheReceiverAsItWas(t *testing.T) {
	canonical := onceflow.ExactlyOnce.Chain()
	before := canonical.String()
	tenant, audit, mine := onceflow.Use("tenant", pass), onceflow.UseObserver("audit", nopObserver{}), onceflow.Use("mine", pass)

	require.Equal(t, "tracing -> metrics -> deadletter -> recover -> tenant -> retry -> timeout -> transaction -> deduplicate",
		canonical.Before(onceflow.StageRetry, tenant).String())
	require.Equal(t, "audit -> tracing -> metrics -> deadletter -> recover -> retry -> timeout -> transaction -> deduplicate",
		canonical.Before(onceflow.StageTracing, audit).String())
	require.Equal(t, "tracing -> metrics -> deadletter -> recover -> retry -> timeout -> transaction -> deduplicate -> tenant -> mine",
		canonical.After(onceflow.StageDeduplicate, tenant, mine).String())
	require.Equal(t, "tracing -> metrics -> deadletter -> recover -> mine -> timeout -> transaction -> deduplicate",
		canonical.Replace(onceflow.StageRetry, mine).String())
	require.Equal(t, "tracing -> metrics -> deadletter -> recover -> retry -> transaction -> deduplicate",
		canonical.Remove(onceflow.StageTimeout).String())
	require.Equal(t, "tracing -> metrics -> recover -> retry -> timeout -> transaction",
		canonical.Remove(onceflow.StageDeadLetter, onceflow.RedeliveredForever).Remove(onceflow.StageDeduplicate, onceflow.AppliedTwice).String())
	// Anchored on a stage of one's own.
	require.Equal(t, []onceflow.StageName{"tracing", "metrics", "deadletter", "recover", "tenant", "mine", "retry", "timeout", "transaction", "deduplicate"},
		canonical.Before(onceflow.StageRetry, tenant).After("tenant", mine).Names())

	require.Equal(t, before, canonical.String(), "the receiver is unchanged")
	edited := canonical.Before(onceflow.StageRetry, tenant)
	_ = edited.Remove("tenant")
	require.Equal(t, "tenant", string(edited.Stages()[4].Name()), "an edit of an edited chain leaves it as it was")
}

func TestChain_AnInvalidEditIsCarriedInTheChainAndTheFirstOneIsReported(t *testing.T) {
	eo := onceflow.ExactlyOnce.Chain()
	tenant := onceflow.Use("tenant", pass)
	for _, tc := range []struct {
		name  string
		chain onceflow.Chain
		want  string
	}{
		{"an anchor the chain does not hold", eo.Before("retri", tenant),
			`Before(retri, tenant): the chain has no stage "retri" (it holds tracing, metrics, deadletter, recover, retry, timeout, transaction, deduplicate)`},
		{"a stage with a built-in's name", eo.After(onceflow.StageRetry, onceflow.Use("transaction", pass)),
			`After(retry, transaction): stage name "transaction" is the name of a built-in stage`},
		{"a name the chain holds already", eo.Before(onceflow.StageRetry, tenant).After(onceflow.StageTransaction, tenant),
			`After(transaction, tenant): the chain holds a stage named "tenant" already`},
		{"an empty name", eo.Before(onceflow.StageRetry, onceflow.Use("", pass)), "a stage has an empty name"},
		{"a name with a space", eo.Before(onceflow.StageRetry, onceflow.Use("my tenant", pass)), `stage name "my tenant" holds a space`},
		{"a nil middleware", eo.Before(onceflow.StageRetry, onceflow.Use("tenant", nil)), `stage "tenant" has no middleware, observer or factory`},
		{"the zero stage", eo.Replace(onceflow.StageRetry, onceflow.Stage{}), "a stage has an empty name"},
		{"nothing to insert", eo.Before(onceflow.StageRetry), "Before(retry, ): no stage to insert"},
		{"removing a stage the chain does not hold", eo.Remove(onceflow.StageInOrder), `Remove(in-order): the chain has no stage "in-order"`},
		{"removing the dead-letter stage without saying so", eo.Remove(onceflow.StageDeadLetter),
			"Remove(deadletter): ExactlyOnce promises that a message that cannot succeed is dead-lettered; pass onceflow.RedeliveredForever to give that up"},
		{"removing duplicate detection without saying so", eo.Remove(onceflow.StageDeduplicate),
			"Remove(deduplicate): ExactlyOnce promises that a message is applied once; pass onceflow.AppliedTwice to give that up"},
		{"removing in-order without saying so", onceflow.ExactlyOnceInOrder.Chain().Remove(onceflow.StageInOrder),
			"Remove(in-order): ExactlyOnceInOrder promises that each key's messages are applied in sequence order; pass onceflow.AppliedOutOfOrder to give that up"},
		{"removing the transaction without saying so", onceflow.BestEffort.Chain().Remove(onceflow.StageTransaction),
			"Remove(transaction): BestEffort promises that a message's writes commit or roll back together; pass onceflow.PartlyApplied to give that up"},
		{"a risk that is not the stage's", eo.Remove(onceflow.StageDeadLetter, onceflow.AppliedTwice),
			"Remove(deadletter, [AppliedTwice]): removing deadletter gives up onceflow.RedeliveredForever, not AppliedTwice"},
		{"a risk for a stage that promises nothing", eo.Remove(onceflow.StageRetry, onceflow.RedeliveredForever),
			"removing retry gives up nothing that needs saying, not RedeliveredForever"},
		{"a replaced promised stage keeps its promise", eo.Replace(onceflow.StageDeadLetter, onceflow.Use("mydlq", pass)).Remove("mydlq"),
			"Remove(mydlq): ExactlyOnce promises that a message that cannot succeed is dead-lettered"},
		{"the first error wins", eo.Before("nope", tenant).Remove(onceflow.StageDeadLetter), `Before(nope, tenant): the chain has no stage "nope"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorContains(t, tc.chain.Err(), tc.want)
			require.Contains(t, tc.chain.String(), "(invalid: ")
		})
	}
	// Saying so makes the chain valid.
	require.NoError(t, eo.Remove(onceflow.StageDeadLetter, onceflow.RedeliveredForever).Err())
	require.NoError(t, eo.Replace(onceflow.StageDeadLetter, onceflow.Use("mydlq", pass)).Err(), "a replacement keeps the promise")
	// A stage taken from a chain where it replaced a built-in one takes no role where it is
	// inserted: removing it there gives up nothing.
	mydlq := eo.Replace(onceflow.StageDeadLetter, onceflow.Use("mydlq", pass)).Stages()[2]
	require.NoError(t, eo.Before(onceflow.StageRetry, mydlq).Remove("mydlq").Err())
}

// One line puts a stage of one's own into the canonical chain, and it runs there for a real
// message: before retry it runs once per delivery, outside the transaction; after transaction
// it runs once per attempt, in the attempt's transaction. With a transaction per message it sees
// a redelivered copy before deduplicate refuses it; under group commit the group records its
// ids first, and the copy reaches no stage inside the transaction.
func TestChain_AStageOfOnesOwnRunsWhereItIsPlaced(t *testing.T) {
	for _, m := range modesOf(t) {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			f := newModeFixture(t, testsvc.Databases()[0], m) // SQLite
			var outer, inner, outerInTx, innerInTx atomic.Int32
			watch := func(runs, inTx *atomic.Int32) middleware.Middleware {
				return func(next processor.Processor) processor.Processor {
					return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
						runs.Add(1)
						if _, ok := processor.TxFromContext(ctx); ok {
							inTx.Add(1)
						}
						return next.Process(ctx, msg)
					})
				}
			}
			chain := onceflow.ExactlyOnce.Chain().Before(onceflow.StageRetry, onceflow.Use("tenant", watch(&outer, &outerInTx)))
			chain = chain.After(onceflow.StageTransaction, onceflow.Use("audit", watch(&inner, &innerInTx)))
			require.Equal(t, "tracing -> metrics -> deadletter -> recover -> tenant -> retry -> timeout -> transaction -> audit -> deduplicate", chain.String())

			var calls atomic.Int32
			f.startRouter(t, onceflow.Handler{
				Chain: chain,
				Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					if calls.Add(1) == 1 {
						return errors.New("the first attempt fails")
					}
					return applyEffect(ctx, msg)
				}),
			})
			f.publish(t, "m-1", "x")
			f.waitAcks(t, "m-1", 1)
			require.Equal(t, int32(1), outer.Load(), "before retry: once per delivery")
			require.Equal(t, int32(0), outerInTx.Load(), "before retry: outside the transaction")
			require.Equal(t, int32(2), inner.Load(), "after transaction: once per attempt")
			require.Equal(t, int32(2), innerInTx.Load(), "after transaction: in the attempt's transaction")
			require.Equal(t, 1, countEffects(t, f.db, "m-1"))
			require.Equal(t, 0, f.broker.Nacks("m-1"))

			f.publish(t, "m-1", "x") // a redelivered copy
			f.waitAcks(t, "m-1", 2)
			require.Equal(t, int32(2), outer.Load())
			want := int32(3) // between transaction and deduplicate, the copy is seen before it is refused
			if m.group() {
				want = 2 // the group recorded the ids first: a duplicate runs nothing inside the transaction
			}
			require.Equal(t, want, inner.Load())
			require.Equal(t, 1, countEffects(t, f.db, "m-1"))
		})
	}
}

// modesOf returns the router tests' commit modes.
func modesOf(*testing.T) []mode { return modes }

// A chain that drops what its quality of service promises runs once the user says so: without
// the dead-letter stage, a message that fails permanently is redelivered, never dead-lettered.
func TestChain_WithoutTheDeadLetterStageAPermanentFailureIsRedeliveredAsPromised(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	var calls atomic.Int32
	f.startRouter(t, onceflow.Handler{
		Chain: onceflow.AtLeastOnce.Chain().Remove(onceflow.StageDeadLetter, onceflow.RedeliveredForever),
		Processor: processor.Func(func(context.Context, *messagedata.MessageData) error {
			calls.Add(1)
			return processor.Permanent(errors.New("rejected"))
		}),
	})
	f.publish(t, "m-1", "x")
	testsvc.Eventually(t, 10*time.Second, func() bool { return f.broker.Nacks("m-1") >= 3 }, "%d nacks", f.broker.Nacks("m-1"))
	require.Empty(t, f.deadLetters())
	require.Equal(t, 0, f.broker.Acks("m-1"))
}

// A setting that the chain would ignore is an error at AddHandler, naming the field and the
// stage that reads it; so is a chain that cannot run with the other settings.
func TestAddHandler_RefusesSettingsTheChainWouldIgnore(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	eo := onceflow.ExactlyOnce.Chain()
	mine := onceflow.Use("mine", pass)
	batch := processor.BatchFunc(func(context.Context, []*messagedata.MessageData) error { return nil })
	for _, tc := range []struct {
		name string
		h    onceflow.Handler
		want string
	}{
		{"a timeout without the timeout stage", onceflow.Handler{Chain: eo.Remove(onceflow.StageTimeout), Timeout: 200 * time.Millisecond},
			"Handler.Timeout: set, but the chain has no timeout stage, which reads it (handler \"h\"; keep the timeout stage in Handler.Chain, or leave Handler.Timeout zero)"},
		{"retry settings without the retry stage", onceflow.Handler{Chain: eo.Remove(onceflow.StageRetry), Retry: middleware.Retry{MaxAttempts: 5}},
			"Handler.Retry.MaxAttempts: set, but the chain has no retry stage, which reads it (handler \"h\"; keep the retry stage in Handler.Chain"},
		{"retry settings with retry replaced", onceflow.Handler{Chain: eo.Replace(onceflow.StageRetry, mine), Retry: middleware.Retry{InitialInterval: 1}},
			`Handler.Retry.InitialInterval: set, but the chain's retry stage is "mine", a stage of one's own, which reads it (handler "h"; configure "mine" itself, or keep the built-in retry stage`},
		{"a classifier without the dead-letter stage", onceflow.Handler{
			Chain: eo.Remove(onceflow.StageDeadLetter, onceflow.RedeliveredForever), DeadLetter: middleware.DeadLetter{Classifier: middleware.DefaultClassifier}},
			"Handler.DeadLetter.Classifier: set, but the chain has no deadletter stage, which reads it (handler \"h\"; keep the deadletter stage in Handler.Chain"},
		{"a delivery limit without the dead-letter stage", onceflow.Handler{
			Chain: eo.Remove(onceflow.StageDeadLetter, onceflow.RedeliveredForever), DeadLetter: middleware.DeadLetter{MaxDeliveries: 3}},
			"Handler.DeadLetter.MaxDeliveries: set, but the chain has no deadletter stage, which reads it"},
		{"a delivery limit with best effort", onceflow.Handler{QoS: onceflow.BestEffort, DeadLetter: middleware.DeadLetter{MaxDeliveries: 3}},
			"Handler.DeadLetter.MaxDeliveries: set, but the chain of BestEffort has no deadletter stage, which reads it (handler \"h\"; use AtLeastOnce or ExactlyOnce or ExactlyOnceInOrder, whose chains have one"},
		{"redelivery delays with best effort", onceflow.Handler{QoS: onceflow.BestEffort, Redelivery: onceflow.RedeliveryConfig{Delays: []time.Duration{1}}},
			"Handler.Redelivery.Delays: set, but BestEffort acknowledges each message on receipt"},
		{"dedup settings with at least once", onceflow.Handler{QoS: onceflow.AtLeastOnce, Dedup: middleware.Dedup{Table: "message_log"}},
			"Handler.Dedup.Table: set, but the chain of AtLeastOnce has no deduplicate stage, which reads it (handler \"h\"; use ExactlyOnce or ExactlyOnceInOrder, whose chains have one"},
		{"dedup settings without duplicate detection", onceflow.Handler{Chain: eo.Remove(onceflow.StageDeduplicate, onceflow.AppliedTwice),
			Dedup: middleware.Dedup{WithTimestamp: true}},
			"Handler.Dedup.WithTimestamp: set, but the chain has no deduplicate stage, which reads it"},
		{"order settings without in-order", onceflow.Handler{QoS: onceflow.ExactlyOnce, Order: onceflow.OrderConfig{AllowUnkeyed: true}},
			"Handler.Order: set, but the chain of ExactlyOnce has no in-order stage"},
		{"an isolation level without the transaction", onceflow.Handler{
			Chain:       eo.Remove(onceflow.StageDeduplicate, onceflow.AppliedTwice).Remove(onceflow.StageTransaction, onceflow.PartlyApplied),
			Transaction: middleware.Transaction{Isolation: 1}},
			"Handler.Transaction.Isolation: set, but the chain has no transaction stage, which reads it"},
		{"a dedup mode without duplicate detection", onceflow.Handler{QoS: onceflow.AtLeastOnce, Dedup: middleware.Dedup{Mode: middleware.DedupByOffset}},
			"Handler.Dedup.Mode: set, but the chain of AtLeastOnce has no deduplicate stage"},
		{"a chain without the dead-letter stage, unsaid", onceflow.Handler{Chain: onceflow.AtLeastOnce.Chain().Remove(onceflow.StageDeadLetter)},
			"Handler.Chain: Remove(deadletter): AtLeastOnce promises that a message that cannot succeed is dead-lettered; pass onceflow.RedeliveredForever to give that up"},
		{"exactly once without duplicate detection, unsaid", onceflow.Handler{Chain: eo.Remove(onceflow.StageDeduplicate)},
			"Handler.Chain: Remove(deduplicate): ExactlyOnce promises that a message is applied once; pass onceflow.AppliedTwice to give that up"},
		{"in order without in-order, unsaid", onceflow.Handler{Chain: onceflow.ExactlyOnceInOrder.Chain().Remove(onceflow.StageInOrder)},
			"Handler.Chain: Remove(in-order): ExactlyOnceInOrder promises that each key's messages are applied in sequence order; pass onceflow.AppliedOutOfOrder to give that up"},
		{"no transaction, unsaid", onceflow.Handler{Chain: onceflow.AtLeastOnce.Chain().Remove(onceflow.StageTransaction)},
			"Handler.Chain: Remove(transaction): AtLeastOnce promises that a message's writes commit or roll back together; pass onceflow.PartlyApplied to give that up"},
		{"a negative retry count", onceflow.Handler{QoS: onceflow.ExactlyOnce, Retry: middleware.Retry{MaxAttempts: -1}},
			"Handler.Retry.MaxAttempts: -1 is negative"},
		{"group commit sizes with group commit off", onceflow.Handler{QoS: onceflow.ExactlyOnce, GroupCommit: onceflow.GroupCommitConfig{Disabled: true, MaxWait: 1}},
			"Handler.GroupCommit.MaxWait: set, but group commit is off: GroupCommit.Disabled is set"},
		{"a batch processor with a stage inside the transaction", onceflow.Handler{Chain: eo.After(onceflow.StageTransaction, mine), BatchProcessor: batch},
			"Handler.BatchProcessor: stage mine is inside the transaction"},
		{"a batch processor without the transaction", onceflow.Handler{Chain: eo.Replace(onceflow.StageTransaction, mine), BatchProcessor: batch},
			`Handler.BatchProcessor: set, but the chain's transaction stage is "mine", a stage of one's own, which hands it a group's messages`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker})
			require.NoError(t, err)
			h := tc.h
			h.Name, h.Topic, h.Subscriber, h.DB = "h", "t", f.broker.Subscriber(), f.db
			if h.BatchProcessor == nil {
				h.Processor = processor.Func(applyEffect)
			}
			require.ErrorContains(t, r.AddHandler(h), tc.want)
		})
	}
}

// nopObserver is an observer that does nothing.
type nopObserver struct{}

func (nopObserver) Begin(ctx context.Context, _ *messagedata.MessageData) context.Context { return ctx }
func (nopObserver) End(context.Context, *messagedata.MessageData, error)                  {}
