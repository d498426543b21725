package onceflow_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// beyondRetention returns the onceflow.dedup.beyond_retention count of reason.
func beyondRetention(t *testing.T, reader *sdkmetric.ManualReader, reason string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "onceflow.dedup.beyond_retention" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if v, _ := dp.Attributes.Value("onceflow.reason"); v.AsString() == reason {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// startRetentionRouter starts a router whose handler keeps keys for retention and applies
// policy, with its metrics on reader.
func (f *fixture) startRetentionRouter(t *testing.T, retention time.Duration, policy dedup.RetentionPolicy) *sdkmetric.ManualReader {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	require.NoError(t, err)
	h := f.mode.handler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: f.broker.Subscriber(), DB: f.db, QoS: onceflow.ExactlyOnce,
		Dedup:     middleware.Dedup{Retention: retention, BeyondRetention: policy},
		Processor: processor.Func(applyEffect),
	})
	if f.mode.group() {
		h.GroupCommit.MaxSize = 1 // one message at a time: the scenario has no companions
	}
	require.NoError(t, r.AddHandler(h))
	stop := runRouter(t, r)
	t.Cleanup(func() { require.NoError(t, stop()) })
	return reader
}

func TestRetention_RedeliveryWhoseExpiredKeyIsStillRecordedIsDeadLetteredAndCounted(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		const retention = 300 * time.Millisecond
		reader := f.startRetentionRouter(t, retention, dedup.DeadLetterExpiredKeys)
		f.publish(t, "m", "first")
		f.waitAcks(t, "m", 1)
		time.Sleep(retention) // the key expires; no purge runs
		f.publish(t, "m", "again")
		f.waitAcks(t, "m", 2)

		require.Equal(t, 1, countEffects(t, f.db, "m"), "not applied twice")
		dead := f.deadLetters()
		require.Len(t, dead, 1)
		require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "delivered beyond the dedup retention (expired_key)")
		require.Equal(t, int64(1), beyondRetention(t, reader, dedup.BeyondExpiredKey))
		require.Equal(t, 1, countDedup(t, f.db, "m"))
	})
}

func TestRetention_ProcessPolicyAppliesItAgainAndCountsIt(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		const retention = 300 * time.Millisecond
		reader := f.startRetentionRouter(t, retention, dedup.ProcessBeyondRetention)
		f.publish(t, "m", "first")
		f.waitAcks(t, "m", 1)
		time.Sleep(retention)
		f.publish(t, "m", "again")
		f.waitAcks(t, "m", 2)
		require.Equal(t, 2, countEffects(t, f.db, "m"), "the documented cost of processing beyond the retention")
		require.Empty(t, f.deadLetters())
		require.Equal(t, int64(1), beyondRetention(t, reader, dedup.BeyondExpiredKey))
	})
}

func TestRetention_MessageOlderThanTheRetentionIsProcessedAndCountedOrDeadLettered(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		for policy, dead := range map[dedup.RetentionPolicy]bool{dedup.DeadLetterExpiredKeys: false, dedup.DeadLetterBeyondRetention: true} {
			for _, m := range modes {
				f := newModeFixture(t, d, m)
				reader := f.startRetentionRouter(t, time.Hour, policy)
				old := message.NewMessage("old", []byte("x"))
				old.Metadata.Set(messagedata.HeaderTimestamp, time.Now().Add(-2*time.Hour).UTC().Format(time.RFC3339Nano))
				require.NoError(t, f.broker.Publish(topic, old))
				f.waitAcks(t, "old", 1)
				require.Equal(t, int64(1), beyondRetention(t, reader, dedup.BeyondOldMessage), policy.String())
				if dead {
					require.Equal(t, 0, countEffects(t, f.db, "old"), policy.String())
					require.Len(t, f.deadLetters(), 1, policy.String())
				} else {
					require.Equal(t, 1, countEffects(t, f.db, "old"), policy.String())
					require.Empty(t, f.deadLetters(), policy.String())
				}
			}
		}
	})
}
