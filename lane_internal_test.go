package onceflow

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// laneHandler returns h named "effects", consuming topic "orders" from b.
func laneHandler(h Handler, b *brokertest.Broker) Handler {
	h.Name, h.Topic, h.Subscriber = "effects", "orders", b.Subscriber()
	return h
}

func TestLane_ChainsThatHandTheirMessagesToGroupCommitHaveOne(t *testing.T) {
	db := testsvc.SQLite(t)
	b := brokertest.New()
	t.Cleanup(func() { _ = b.Close() })
	noop := processor.Func(func(context.Context, *messagedata.MessageData) error { return nil })
	batch := processor.BatchFunc(func(context.Context, []*messagedata.MessageData) error { return nil })
	watch := middleware.Middleware(func(next processor.Processor) processor.Processor { return next })
	cases := []struct {
		name string
		h    Handler
		lane bool
	}{
		{"exactly-once with group commit", Handler{QoS: ExactlyOnce, GroupCommit: GroupCommitConfig{}, Processor: noop}, true},
		{"exactly-once with a batch processor and a timeout", Handler{QoS: ExactlyOnce, BatchProcessor: batch, Timeout: time.Second}, true},
		{"at-least-once with group commit", Handler{QoS: AtLeastOnce, GroupCommit: GroupCommitConfig{}, Processor: noop}, true},
		{"in order with group commit", Handler{QoS: ExactlyOnceInOrder, GroupCommit: GroupCommitConfig{}, Processor: noop}, true},
		{"by offset with group commit", Handler{QoS: ExactlyOnce, Dedup: middleware.Dedup{Mode: middleware.DedupByOffset}, GroupCommit: GroupCommitConfig{}, Processor: noop}, true},
		{"by offset, a transaction per message", Handler{QoS: ExactlyOnce, Dedup: middleware.Dedup{Mode: middleware.DedupByOffset},
			GroupCommit: GroupCommitConfig{Disabled: true}, Processor: noop}, false},
		{"a chain without some built-ins", Handler{Chain: ExactlyOnce.Chain().Remove(StageTracing).Remove(StageDeadLetter, RedeliveredForever).Remove(StageRecover),
			GroupCommit: GroupCommitConfig{}, Processor: noop}, true},
		{"a transaction per message", Handler{QoS: ExactlyOnce, GroupCommit: GroupCommitConfig{Disabled: true}, Processor: noop}, false},
		{"exactly-once by default", Handler{QoS: ExactlyOnce, Processor: noop}, true},
		{"best effort", Handler{QoS: BestEffort, GroupCommit: GroupCommitConfig{}, Processor: noop}, false},
		{"a middleware of its own before group commit", Handler{Chain: ExactlyOnce.Chain().Before(StageTransaction, Use("watch", watch)),
			GroupCommit: GroupCommitConfig{}, Processor: noop}, false},
		{"a middleware of its own inside group commit", Handler{Chain: ExactlyOnce.Chain().After(StageTransaction, Use("watch", watch)),
			GroupCommit: GroupCommitConfig{}, Processor: noop}, true},
		{"an observer of its own before group commit", Handler{Chain: ExactlyOnce.Chain().Before(StageTracing, UseObserver("audit", audit{})),
			GroupCommit: GroupCommitConfig{}, Processor: noop}, true},
		{"an observer of its own after a stage that acts", Handler{Chain: ExactlyOnce.Chain().After(StageRetry, UseObserver("audit", audit{})),
			GroupCommit: GroupCommitConfig{}, Processor: noop}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := NewRouter(Config{DeadLetterPublisher: b, PurgeInterval: -1})
			require.NoError(t, err)
			h := laneHandler(tc.h, b)
			h.DB = db
			require.NoError(t, r.AddHandler(h))
			require.Equal(t, tc.lane, r.handlers[0].lane != nil)
		})
	}
}

func TestLane_DeliveriesWaitForTheirGroupWithoutAGoroutineEach(t *testing.T) {
	db := testsvc.SQLite(t)
	_, err := db.Exec(`CREATE TABLE effects (message_id TEXT NOT NULL)`)
	require.NoError(t, err)
	b := brokertest.New()
	b.Prefetch = 512
	t.Cleanup(func() { _ = b.Close() })

	const n, size = 300, 64
	entered, release := make(chan struct{}, 1), make(chan struct{})
	var calls atomic.Int32
	r, err := NewRouter(Config{DeadLetterPublisher: b, PurgeInterval: -1, CloseTimeout: 5 * time.Second})
	require.NoError(t, err)
	h := laneHandler(Handler{
		QoS:         ExactlyOnce,
		DB:          db,
		GroupCommit: GroupCommitConfig{MaxSize: size},
		BatchProcessor: processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			if calls.Add(1) == 1 {
				entered <- struct{}{}
				<-release
			}
			tx, _ := processor.TxFromContext(ctx)
			for _, m := range msgs {
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects (message_id) VALUES (?)`, m.ID); err != nil {
					return err
				}
			}
			return nil
		}),
	}, b)
	require.NoError(t, r.AddHandler(h))
	testsvc.StartRouter(t, r)

	for i := range n {
		require.NoError(t, b.Publish("orders", message.NewMessage(fmt.Sprintf("m-%d", i), nil)))
	}
	<-entered
	// The first group is held in the batch processor; deliveries are admitted until the
	// handler's slots are full: the held group's and those of the groups waiting behind it.
	slots := cap(r.handlers[0].slots)
	testsvc.Eventually(t, 10*time.Second, func() bool { return len(r.handlers[0].slots) == slots },
		"%d of %d slots taken", len(r.handlers[0].slots), slots)
	require.Equal(t, 2*size, slots)
	require.Less(t, routerGoroutines(), 8, "%d deliveries in flight hold %d goroutines of the router", slots, routerGoroutines())

	close(release)
	testsvc.Eventually(t, 15*time.Second, func() bool { return b.TotalAcks() == n }, "%d of %d acked", b.TotalAcks(), n)
	var effects, distinct int
	require.NoError(t, db.QueryRow(`SELECT COUNT(*), COUNT(DISTINCT message_id) FROM effects`).Scan(&effects, &distinct))
	require.Equal(t, n, effects)
	require.Equal(t, n, distinct)
	require.Equal(t, 0, b.TotalNacks())
	require.Less(t, int(calls.Load()), n/2, "the batch processor saw groups, not single messages")
	flushes, early := b.Flushes()
	require.Equal(t, int(calls.Load()), flushes, "each group's acknowledgements are flushed once")
	require.Zero(t, early, "a flush comes after its message's acknowledgement")
}

// routerGoroutines counts the goroutines running the router's or the middlewares' code (the
// in-memory broker keeps one per delivery of its own).
func routerGoroutines() int {
	buf := make([]byte, 1<<22)
	n := 0
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "github.com/onceflow/onceflow.(*") || strings.Contains(g, "github.com/onceflow/onceflow/middleware.") {
			n++
		}
	}
	return n
}

// audit is an observer that does nothing.
type audit struct{}

func (audit) Begin(ctx context.Context, _ *messagedata.MessageData) context.Context { return ctx }
func (audit) End(context.Context, *messagedata.MessageData, error)                  {}
