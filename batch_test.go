package onceflow_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// insertEffects writes the effects of msgs with one multi-row INSERT.
func insertEffects(ctx context.Context, msgs []*messagedata.MessageData) error {
	tx, _ := processor.TxFromContext(ctx)
	var q strings.Builder
	args := make([]any, 0, 2*len(msgs))
	q.WriteString(`INSERT INTO effects (message_id, note) VALUES `)
	for i, m := range msgs {
		if i > 0 {
			q.WriteString(",")
		}
		q.WriteString("(?, ?)")
		args = append(args, m.ID, string(m.Payload))
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(q.String()), args...)
	return err
}

func TestBatchProcessor_AppliesEveryMessageOnceInFewCallsAndDeadLettersTheBadOne(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.broker.Prefetch = 20
		var mu sync.Mutex
		var sizes []int
		type order struct{ Cents int }
		f.startRouter(t, onceflow.Handler{
			QoS:         onceflow.ExactlyOnce,
			Processor:   nil,
			Concurrency: 1,
			GroupCommit: onceflow.GroupCommitConfig{MaxSize: 20, MaxWait: 20 * time.Millisecond},
			BatchProcessor: processor.JSONBatch(func(ctx context.Context, msgs []*messagedata.MessageData, vs []order) error {
				mu.Lock()
				sizes = append(sizes, len(msgs))
				mu.Unlock()
				return insertEffects(ctx, msgs)
			}),
		})
		for i := range 40 {
			f.publish(t, fmt.Sprintf("m-%d", i), `{"Cents": 1}`)
		}
		f.publish(t, "bad", `{"Cents": `)
		f.publish(t, "m-0", `{"Cents": 1}`) // a copy
		for i := range 40 {
			f.waitAcks(t, fmt.Sprintf("m-%d", i), 1)
		}
		f.waitAcks(t, "bad", 1)
		f.waitAcks(t, "m-0", 2)
		for i := range 40 {
			require.Equal(t, 1, countEffects(t, f.db, fmt.Sprintf("m-%d", i)))
		}
		require.Equal(t, 0, countEffects(t, f.db, "bad"))
		dead := f.deadLetters()
		require.Len(t, dead, 1)
		require.Equal(t, "bad", dead[0].UUID)
		mu.Lock()
		defer mu.Unlock()
		total := 0
		for _, n := range sizes {
			total += n
		}
		require.Equal(t, 40, total, "each message is in the one batch that commits it")
		require.Less(t, len(sizes), 20, "messages share batches")
	})
}

func TestBatchProcessor_InvalidCombinationsAreErrors(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	batch := processor.BatchFunc(insertEffects)
	base := onceflow.Handler{Name: "h", Topic: topic, Subscriber: f.broker.Subscriber(), DB: f.db, QoS: onceflow.ExactlyOnce}
	for name, tc := range map[string]struct {
		h    func(onceflow.Handler) onceflow.Handler
		want string
	}{
		"both processors": {func(h onceflow.Handler) onceflow.Handler {
			h.Processor, h.BatchProcessor = processor.Func(applyEffect), batch
			return h
		}, "Handler.BatchProcessor"},
		"in order": {func(h onceflow.Handler) onceflow.Handler {
			h.BatchProcessor, h.QoS = batch, onceflow.ExactlyOnceInOrder
			return h
		}, "ExactlyOnceInOrder"},
		"a stage inside the transaction": {func(h onceflow.Handler) onceflow.Handler {
			h.BatchProcessor, h.QoS = batch, 0
			h.Chain = onceflow.ExactlyOnce.Chain().After(onceflow.StageTransaction, onceflow.Use("audit", middleware.Recover()))
			return h
		}, "Handler.BatchProcessor: stage audit is inside the transaction"},
	} {
		r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker})
		require.NoError(t, err)
		err = r.AddHandler(tc.h(base))
		require.ErrorContains(t, err, tc.want, name)
	}
}
