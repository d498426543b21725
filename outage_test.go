package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// logLines counts the log records at Info level and above, by message.
type logLines struct {
	mu    sync.Mutex
	lines map[string]int
}

func (l *logLines) Enabled(_ context.Context, level slog.Level) bool { return level >= slog.LevelInfo }
func (l *logLines) WithAttrs([]slog.Attr) slog.Handler               { return l }
func (l *logLines) WithGroup(string) slog.Handler                    { return l }
func (l *logLines) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lines == nil {
		l.lines = map[string]int{}
	}
	l.lines[r.Message]++
	return nil
}

func (l *logLines) count() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]int, len(l.lines))
	for k, v := range l.lines {
		out[k] = v
	}
	return out
}

func TestOutage_GivesDeliveriesBackUncountedAndResumesByItself(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		logs := &logLines{}
		f.logger = slog.New(logs)
		var down atomic.Bool
		down.Store(true)
		r := f.startRouter(t, onceflow.Handler{
			QoS:        onceflow.ExactlyOnce,
			DeadLetter: middleware.DeadLetter{MaxDeliveries: 2},
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if down.Load() {
					return fmt.Errorf("insert the effect: %w", syscall.ECONNREFUSED)
				}
				if msg.ID == "poison" {
					return errors.New("the message's own failure")
				}
				return applyEffect(ctx, msg)
			}),
		})
		f.publish(t, "good", "x")
		f.publish(t, "poison", "x")
		// Both go back again and again, well beyond the delivery limit of 2, uncounted; the
		// handler is paused meanwhile, and takes a delivery now and then to tell.
		testsvc.Eventually(t, 15*time.Second, func() bool {
			return f.broker.Nacks("good")+f.broker.Nacks("poison") >= 6
		}, "deliveries not given back (good %d, poison %d)", f.broker.Nacks("good"), f.broker.Nacks("poison"))
		st := r.Status()[0]
		require.Equal(t, onceflow.StatePaused, st.State.Kind)
		require.Equal(t, "the database is unreachable", st.State.Reason)
		require.Zero(t, st.Counts.Failed)
		require.Zero(t, st.Counts.DeadLettered)

		down.Store(false)
		f.waitAcks(t, "good", 1)
		f.waitAcks(t, "poison", 1)
		require.Equal(t, 1, countEffects(t, f.db, "good"))
		require.Equal(t, 0, countEffects(t, f.db, "poison"))
		dead := f.deadLetters()
		require.Len(t, dead, 1)
		require.Equal(t, "poison", dead[0].UUID)
		require.Equal(t, "permanent: delivery limit reached after 2 deliveries: the message's own failure",
			dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason))

		testsvc.Eventually(t, 5*time.Second, func() bool { return r.Status()[0].State.Kind == onceflow.StateRunning }, "handler not running again")
		st = r.Status()[0]
		require.Equal(t, int64(1), st.Counts.Processed)
		require.Equal(t, int64(1), st.Counts.Failed, "the poison message's first counted delivery: %+v, good nacks %d, poison nacks %d, logs %v", st.Counts, f.broker.Nacks("good"), f.broker.Nacks("poison"), logs.count())
		require.Equal(t, int64(1), st.Counts.DeadLettered)
		require.Equal(t, st.Counts.GivenBack, int64(f.broker.Nacks("good")+f.broker.Nacks("poison")-1))
		// One line for the pause, one for the resumption, and the poison message's own two.
		require.Equal(t, map[string]int{
			"handler paused: a failure that is not its messages'; deliveries are given back uncounted until it is over": 1,
			"handler resumed after an outage": 1,
			"message processing failed":       1,
			"message dead-lettered":           1,
		}, logs.count())
	})
}

func TestOutage_DeadLetterBrokerDown_PoisonMessageWaitsUnacked(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		logs := &logLines{}
		f.logger = slog.New(logs)
		f.broker.FailPublish(onceflow.DefaultDeadLetterTopic, errors.New("dead-letter broker down"))
		r := f.startRouter(t, onceflow.Handler{
			QoS: onceflow.ExactlyOnce,
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if msg.ID == "poison" {
					return processor.Permanent(errors.New("malformed"))
				}
				return applyEffect(ctx, msg)
			}),
		})
		f.publish(t, "poison", "x")
		testsvc.Eventually(t, 15*time.Second, func() bool { return f.broker.Nacks("poison") >= 3 }, "poison message not given back")
		st := r.Status()[0]
		require.Equal(t, onceflow.StatePaused, st.State.Kind)
		require.Equal(t, "the dead-letter broker refuses messages", st.State.Reason)
		require.Zero(t, f.broker.Acks("poison"), "nothing is acked unpublished")

		f.broker.FailPublish(onceflow.DefaultDeadLetterTopic, nil)
		f.waitAcks(t, "poison", 1)
		dead := f.deadLetters()
		require.Len(t, dead, 1)
		require.Equal(t, "poison", dead[0].UUID)
		f.publish(t, "good", "x")
		f.waitAcks(t, "good", 1)
		require.Equal(t, 1, countEffects(t, f.db, "good"))
		require.Equal(t, onceflow.StateRunning, r.Status()[0].State.Kind)
		lines := logs.count()
		require.Equal(t, 1, lines["message dead-lettered"])
		require.LessOrEqual(t, lines["handler paused: a failure that is not its messages'; deliveries are given back uncounted until it is over"], 2)
		require.Zero(t, lines["message processing failed"])
	})
}
