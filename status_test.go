package onceflow_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

func TestStatus_CountsEachDeliveryByItsOutcomeAndSaysTheState(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			f := newModeFixture(t, testsvc.Databases()[0], m) // SQLite: the counting is the router's
			release := make(chan struct{})
			r := f.startRouter(t, onceflow.Handler{
				QoS:        onceflow.ExactlyOnce,
				DeadLetter: middleware.DeadLetter{MaxDeliveries: 2},
				Retry:      middleware.Retry{MaxAttempts: 1},
				Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					switch msg.ID {
					case "bad":
						return processor.Permanent(errors.New("account closed"))
					case "poison":
						return errors.New("timeout")
					case "slow":
						<-release
					}
					return applyEffect(ctx, msg)
				}),
			})
			status := func() onceflow.HandlerStatus {
				t.Helper()
				all := r.Status()
				require.Len(t, all, 1)
				return all[0]
			}
			st := status()
			require.Equal(t, "effects", st.Name)
			require.Equal(t, topic, st.Topic)
			require.Equal(t, onceflow.ExactlyOnce, st.QoS)
			require.Equal(t, onceflow.StateRunning, st.State.Kind)
			require.Empty(t, st.State.Reason)
			require.WithinDuration(t, time.Now(), st.State.Since, 10*time.Second)

			for _, id := range []string{"good-1", "good-2", "bad", "poison", "good-1"} {
				f.publish(t, id, "x")
			}
			want := onceflow.HandlerCounts{Processed: 2, Duplicates: 1, DeadLettered: 2, DeliveryLimit: 1, Failed: 1}
			testsvc.Eventually(t, 15*time.Second, func() bool { return status().Counts == want }, "counts never became %+v (last %+v)", want, status().Counts)
			require.EqualValues(t, 6, want.Total())
			require.Zero(t, status().InFlight)

			f.publish(t, "slow", "x")
			testsvc.Eventually(t, 15*time.Second, func() bool { return status().InFlight == 1 }, "the slow message never showed in flight")
			close(release)
			testsvc.Eventually(t, 15*time.Second, func() bool { return status().InFlight == 0 && status().Counts.Processed == 3 }, "the slow message never ended")

			require.NoError(t, r.Close())
			st = status()
			require.Equal(t, onceflow.State{Kind: onceflow.StateStopped, Reason: "the router closed", Since: st.State.Since}, st.State)
			require.Equal(t, int64(3), st.Counts.Processed, "the counts stay after the router closed")
		})
	}
}

func TestStatus_BeforeRunTheHandlersAreStopped(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testsvc.Databases()[0])
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker})
	require.NoError(t, err)
	require.Empty(t, r.Status())
	require.NoError(t, r.AddHandler(onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: f.broker.Subscriber(), DB: f.db,
		QoS: onceflow.AtLeastOnce, Processor: processor.Func(applyEffect)}))
	st := r.Status()
	require.Len(t, st, 1)
	require.Equal(t, "ledger", st[0].Name)
	require.Equal(t, onceflow.AtLeastOnce, st[0].QoS)
	require.Equal(t, onceflow.StateStopped, st[0].State.Kind)
	require.Equal(t, "the router has not run yet", st[0].State.Reason)
	require.Zero(t, st[0].Counts)
	require.Zero(t, st[0].InFlight)
}

// A handler given its chain and no QoS reports the QoS its chain carries.
func TestStatus_AHandlerGivenAChainReportsItsQoS(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testsvc.Databases()[0])
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker})
	require.NoError(t, err)
	tag := onceflow.Use("tag", func(next processor.Processor) processor.Processor { return next })
	require.NoError(t, r.AddHandler(onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: f.broker.Subscriber(), DB: f.db,
		Chain: onceflow.ExactlyOnceInOrder.Chain().Before(onceflow.StageRetry, tag), Processor: processor.Func(applyEffect)}))
	st := r.Status()
	require.Len(t, st, 1)
	require.Equal(t, onceflow.ExactlyOnceInOrder, st[0].QoS)
}
