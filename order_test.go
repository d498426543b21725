package onceflow_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/processor"
)

// recordApplied is the processor of the in-order tests: it records the key and sequence of
// each applied message (package ordercheck).
func recordApplied(ctx context.Context, md *messagedata.MessageData) error {
	tx, _ := processor.TxFromContext(ctx)
	return ordercheck.Record(ctx, tx, "applied", "run", md.Key, md.Sequence, md.ID, 0)
}

func orderedMessage(id, key string, seq uint64) *message.Message {
	m := message.NewMessage(id, []byte(fmt.Sprintf(`{"amount":%d}`, seq)))
	ordering.SetSequence(m, key, seq)
	return m
}

func TestExactlyOnceInOrder_ShuffledAndDuplicatedMessagesAreAppliedInOrderOnce(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		require.NoError(t, ordercheck.Create(context.Background(), f.db, "applied"))
		f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnceInOrder, Concurrency: 4, Processor: processor.Func(recordApplied)})

		const keys, perKey = 5, 20
		want := map[string]uint64{}
		var msgs []*message.Message
		for k := range keys {
			key := fmt.Sprintf("acct-%d", k)
			want[key] = perKey
			for seq := uint64(1); seq <= perKey; seq++ {
				id := fmt.Sprintf("%s-%d", key, seq)
				msgs = append(msgs, orderedMessage(id, key, seq))
				if seq%4 == 0 {
					msgs = append(msgs, orderedMessage(id, key, seq)) // redelivered copy
				}
				if seq%7 == 0 {
					msgs = append(msgs, orderedMessage(id+"-resent", key, seq)) // a producer's resend
				}
			}
		}
		rand.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
		require.NoError(t, f.broker.Publish(topic, msgs...))

		var res ordercheck.Result
		testsvc.Eventually(t, 30*time.Second, func() bool {
			var err error
			res, err = ordercheck.Tally(context.Background(), f.db, "applied", "run", want)
			require.NoError(t, err)
			return res.Progress() == keys*perKey
		}, "not every message applied")
		testsvc.Eventually(t, 10*time.Second, func() bool { return f.broker.TotalAcks() == len(msgs) }, "not every delivery acked")
		res, err := ordercheck.Tally(context.Background(), f.db, "applied", "run", want)
		require.NoError(t, err)
		require.True(t, res.OK(), "%+v", res)
	})
}

func TestExactlyOnceInOrder_UnkeyedMessageIsDeadLettered(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnceInOrder})
		f.publish(t, "plain", "x")
		f.waitAcks(t, "plain", 1)
		dead := f.broker.Drain(onceflow.DefaultDeadLetterTopic)
		require.Len(t, dead, 1)
		require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "no ordering key and sequence")
		require.Zero(t, countEffects(t, f.db, "plain"))
	})
}

func TestExactlyOnceInOrder_RouterSweepsTimedOutGapsAndObservesParkedMessages(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		require.NoError(t, ordercheck.Create(context.Background(), f.db, "applied"))
		reader := sdkmetric.NewManualReader()
		r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1, CloseTimeout: 5 * time.Second,
			MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
		require.NoError(t, err)
		require.NoError(t, r.AddHandler(onceflow.Handler{
			Name: "ledger", Topic: topic, Subscriber: f.broker.Subscriber(), DB: f.db, QoS: onceflow.ExactlyOnceInOrder,
			Processor: processor.Func(recordApplied),
			Order:     onceflow.OrderConfig{GapTimeout: time.Second, GapPolicy: ordering.Skip, SweepInterval: 50 * time.Millisecond},
		}))
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
		<-r.Running()

		require.NoError(t, f.broker.Publish(topic, orderedMessage("m2", "acct-1", 2), orderedMessage("m3", "acct-1", 3)))
		f.waitAcks(t, "m3", 1)
		gauge := func() int64 {
			var rm metricdata.ResourceMetrics
			require.NoError(t, reader.Collect(context.Background(), &rm))
			for _, sm := range rm.ScopeMetrics {
				for _, m := range sm.Metrics {
					if m.Name == "onceflow.order.parked" {
						for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
							if v, _ := dp.Attributes.Value(attribute.Key("onceflow.handler")); v.AsString() == "ledger" {
								return dp.Value
							}
						}
					}
				}
			}
			return -1
		}
		require.Equal(t, int64(2), gauge(), "both wait for sequence 1")

		// Sequence 1 never comes: after the gap timeout the sweeper skips it.
		want := map[string]uint64{"acct-1": 3}
		testsvc.Eventually(t, 15*time.Second, func() bool {
			res, err := ordercheck.Tally(context.Background(), f.db, "applied", "run", want)
			require.NoError(t, err)
			return res.Applied == 2
		}, "the sweeper did not skip the gap")
		require.Equal(t, int64(0), gauge())

		f.publish(t, "late", "x")
		require.NoError(t, f.broker.Publish(topic, orderedMessage("m1", "acct-1", 1)))
		f.waitAcks(t, "m1", 1)
		dead := f.broker.Drain(onceflow.DefaultDeadLetterTopic)
		require.NotEmpty(t, dead)
		var reasons []string
		for _, m := range dead {
			reasons = append(reasons, m.UUID+": "+m.Metadata.Get(messagedata.HeaderDeadLetterReason))
		}
		require.Contains(t, fmt.Sprint(reasons), "m1: permanent: sequence was skipped")
	})
}

func TestHandler_InOrderNeedsTheTransaction(t *testing.T) {
	t.Parallel()
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: brokertest.New()})
	require.NoError(t, err)
	h := onceflow.Handler{Name: "h", Topic: topic, Subscriber: brokertest.New().Subscriber(), DB: testsvc.SQLite(t), Processor: processor.Func(applyEffect),
		Chain: onceflow.ExactlyOnceInOrder.Chain().Remove(onceflow.StageDeduplicate, onceflow.AppliedTwice).Remove(onceflow.StageTransaction, onceflow.PartlyApplied)}
	require.ErrorContains(t, r.AddHandler(h), `Handler.Chain: stage in-order writes through the transaction, and the chain has no transaction stage`)
}

func TestHandler_OrderConfigIsValidated(t *testing.T) {
	t.Parallel()
	base := onceflow.Handler{Name: "h", Topic: topic, Subscriber: brokertest.New().Subscriber(), DB: testsvc.SQLite(t),
		Processor: processor.Func(applyEffect), QoS: onceflow.ExactlyOnceInOrder}
	for _, tc := range []struct {
		order onceflow.OrderConfig
		want  string
	}{
		{onceflow.OrderConfig{GapTimeout: -time.Second}, "Handler.Order.GapTimeout"},
		{onceflow.OrderConfig{GapPolicy: 9}, "Handler.Order.GapPolicy"},
		{onceflow.OrderConfig{Table: "no-dashes"}, "Handler.Order.Table"},
		{onceflow.OrderConfig{MaxDrain: -1}, "Handler.Order.MaxDrain"},
	} {
		h := base
		h.Order = tc.order
		require.ErrorContains(t, h.Validate(), tc.want)
	}
	require.NoError(t, base.Validate())
}
