package onceflow_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/crashpoint"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// pointRecorder keeps the crash points each message reached.
type pointRecorder struct {
	mu     sync.Mutex
	points map[string][]crashpoint.Point
}

func (r *pointRecorder) reach(p crashpoint.Point, id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.points[id] = append(r.points[id], p)
}

func (r *pointRecorder) of(id string) []crashpoint.Point {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]crashpoint.Point(nil), r.points[id]...)
}

// The router and the chain reach the crash points that a fault-injection run kills its consumer
// at (package onceflowtest), in the order a message meets them: received, before the commit,
// then with the outcome known and the acknowledgement not sent; a dead-lettered message between
// its dead letter's publish and that acknowledgement. With group commit too, where a first
// delivery takes the lane and the group commits for it.
func TestCrashPoints_ReachedInTheOrderAMessageMeetsThem(t *testing.T) {
	rec := &pointRecorder{points: map[string][]crashpoint.Point{}}
	crashpoint.Set(rec.reach)
	t.Cleanup(func() { crashpoint.Set(nil) })
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			f := newModeFixture(t, testsvc.Databases()[0], m)
			good, bad := "crashpoint-good-"+m.name, "crashpoint-bad-"+m.name
			f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce,
				Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					if strings.HasPrefix(msg.ID, "crashpoint-bad-") {
						return processor.Permanent(errors.New("cannot succeed"))
					}
					return applyEffect(ctx, msg)
				})})
			f.publishWithCompanions(t, good, "x")
			f.publish(t, bad, "x")
			f.waitAcks(t, good, 1)
			f.waitAcks(t, bad, 1)

			require.Equal(t, []crashpoint.Point{crashpoint.Received, crashpoint.BeforeCommit, crashpoint.AfterCommit}, rec.of(good))
			require.Equal(t, []crashpoint.Point{crashpoint.Received, crashpoint.DeadLettered, crashpoint.AfterCommit}, rec.of(bad))
			f.checkCompanions(t, good, 1)
		})
	}
}
