package conformance_test

import (
	"context"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/conformance"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// One line puts a stage of one's own into the canonical ExactlyOnce chain; the chain prints it
// in place, and the handlers made with it pass the exactly-once scenarios, in every commit
// mode, on RabbitMQ with PostgreSQL and on the embedded default.
func TestConformance_AStageOfOnesOwnInTheExactlyOnceChain(t *testing.T) {
	var runs atomic.Int64
	tenant := onceflow.Use("tenant", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			runs.Add(1)
			return next.Process(ctx, msg)
		})
	})
	edit := func(c onceflow.Chain) onceflow.Chain { return c.Before(onceflow.StageRetry, tenant) }
	require.Equal(t, "tracing -> metrics -> deadletter -> recover -> tenant -> retry -> timeout -> transaction -> deduplicate",
		edit(onceflow.ExactlyOnce.Chain()).String())

	var ran atomic.Bool // false when a -run filter leaves the pairs out
	others := slices.DeleteFunc(slices.Clone(conformance.ScenarioNames), func(s string) bool { return s == conformance.ScenarioPoison })
	t.Run("pairs", func(t *testing.T) {
		t.Run("amqp/postgres", func(t *testing.T) {
			t.Parallel()
			ran.Store(true)
			conformance.Run(t, conformance.Setup{
				BrokerURL:   func(t testing.TB) string { pgSlots.take(t, 3); return testsvc.AMQPURL(t) },
				DatabaseURL: freshPostgres,
				Scenarios:   others,
				Chain:       edit,
			}, conformance.DefaultFeatures("amqp://"))
		})
		t.Run("sqlite/sqlite", func(t *testing.T) {
			t.Parallel()
			ran.Store(true)
			conformance.Run(t, conformance.Setup{
				BrokerURL:   func(t testing.TB) string { return "sqlite://" + filepath.Join(t.TempDir(), "queue.db") },
				DatabaseURL: func(t testing.TB) string { return "sqlite://" + filepath.Join(t.TempDir(), "app.db") },
				Scenarios:   others,
				Chain:       edit,
			}, conformance.DefaultFeatures("sqlite://"))
		})
	})
	if ran.Load() {
		require.Positive(t, runs.Load(), "the stage ran")
	}
}
