package onceflow_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// Under group commit a first delivery joins its group without a goroutine of its own (the
// lane); the interceptors before group commit see it only when its first attempt did not
// commit. These outcomes must be those of a delivery that went through them all along: the
// first attempt counts as one, a retry runs once more, a permanent failure is dead-lettered
// without a second run, a panic is nacked; each delivery has one consumer span and one outcome.
func TestLane_EachOutcomeIsTheChainsWithTheFirstAttemptCountedOnce(t *testing.T) {
	o := newObserved(t)
	var mu sync.Mutex
	calls := map[string]int{}
	o.start(t, onceflow.Handler{
		QoS:         onceflow.ExactlyOnce,
		GroupCommit: onceflow.GroupCommitConfig{},
		Retry:       middleware.Retry{MaxAttempts: 3},
		DeadLetter:  middleware.DeadLetter{MaxDeliveries: 2},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			mu.Lock()
			calls[msg.ID]++
			n := calls[msg.ID]
			mu.Unlock()
			switch msg.ID {
			case "retried":
				if n == 1 {
					return errors.New("deadlock detected")
				}
			case "permanent":
				return processor.Permanent(errors.New("amount is negative"))
			case "panics":
				panic("bad state")
			}
			return applyEffect(ctx, msg)
		}),
	})

	for _, id := range []string{"ok", "retried", "permanent", "panics"} {
		o.produce(t, id, "x")
	}
	// One delivery each, and a second for the panic, nacked the first time and dead-lettered
	// at the delivery limit the second.
	spans := o.waitDeliveries(t, 5)

	mu.Lock()
	require.Equal(t, map[string]int{"ok": 1, "retried": 2, "permanent": 1, "panics": 2}, calls)
	mu.Unlock()
	perID := map[string]int{}
	for _, s := range spans {
		require.Equal(t, trace.SpanKindConsumer, s.SpanKind())
		perID[attrs(s)["messaging.message.id"].AsString()]++
	}
	require.Equal(t, map[string]int{"ok": 1, "retried": 1, "permanent": 1, "panics": 2}, perID)

	rm := o.metrics(t)
	require.Equal(t, map[processor.Outcome]int64{processor.Processed: 2, processor.DeadLettered: 2, processor.Panicked: 1}, outcomes(t, rm))
	require.Equal(t, int64(1), counter(t, rm, "onceflow.retries", handlerAttr))
	require.Equal(t, int64(0), counter(t, rm, "onceflow.inflight", handlerAttr))

	for id, want := range map[string][3]int{"ok": {1, 0, 1}, "retried": {1, 0, 1}, "permanent": {1, 0, 0}, "panics": {1, 1, 0}} {
		require.Equal(t, want[0], o.broker.Acks(id), "acks of %s", id)
		require.Equal(t, want[1], o.broker.Nacks(id), "nacks of %s", id)
		require.Equal(t, want[2], countEffects(t, o.db, id), "effects of %s", id)
	}
	var dead []string
	for _, m := range o.broker.Drain(onceflow.DefaultDeadLetterTopic) {
		dead = append(dead, m.UUID)
	}
	require.ElementsMatch(t, []string{"permanent", "panics"}, dead)
}

// counting is an observer that counts the deliveries it sees begin and end, by outcome.
type counting struct {
	mu     sync.Mutex
	begun  int
	ended  map[processor.Outcome]int
	active int
}

func (c *counting) Begin(ctx context.Context, _ *messagedata.MessageData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.begun++
	c.active++
	return ctx
}

func (c *counting) End(_ context.Context, _ *messagedata.MessageData, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ended[processor.OutcomeOf(err)]++
	c.active--
}

func TestUseObserver_SeesEachDeliveryOnceUnderGroupCommit(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0]) // SQLite
	obs := &counting{ended: map[processor.Outcome]int{}}
	f.startRouter(t, onceflow.Handler{
		Chain:       onceflow.ExactlyOnce.Chain().Before(onceflow.StageTracing, onceflow.UseObserver("count", obs)),
		GroupCommit: onceflow.GroupCommitConfig{},
		Concurrency: 2,
		Retry:       middleware.Retry{MaxAttempts: 2},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if msg.ID == "bad" {
				return processor.Permanent(errors.New("amount is negative"))
			}
			return applyEffect(ctx, msg)
		}),
	})

	ids := []string{"a", "b", "c", "bad"}
	for _, id := range ids {
		f.publish(t, id, "x")
	}
	for _, id := range ids {
		f.waitAcks(t, id, 1)
	}
	testsvc.Eventually(t, 5*time.Second, func() bool { obs.mu.Lock(); defer obs.mu.Unlock(); return obs.active == 0 }, "observer still active")
	obs.mu.Lock()
	defer obs.mu.Unlock()
	require.Equal(t, 4, obs.begun)
	require.Equal(t, map[processor.Outcome]int{processor.Processed: 3, processor.DeadLettered: 1}, obs.ended)
	for _, id := range ids[:3] {
		require.Equal(t, 1, countEffects(t, f.db, id))
	}
}
