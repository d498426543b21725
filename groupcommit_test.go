package onceflow_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/groupcommit"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// heldDB is a Beginner whose commits wait until the test lets them go, and are counted.
type heldDB struct {
	db         *sqldb.DB
	committing chan struct{} // closed when the first commit is reached
	release    chan struct{} // closed by the test to let commits go
	once       sync.Once
	commits    atomic.Int32
}

func (h *heldDB) BeginTx(ctx context.Context, opts *sql.TxOptions) (middleware.Tx, error) {
	tx, err := h.db.BeginTxx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &heldTx{Tx: tx, h: h}, nil
}

type heldTx struct {
	*sqlx.Tx
	h *heldDB
}

func (t *heldTx) Commit() error {
	t.h.once.Do(func() { close(t.h.committing) })
	<-t.h.release
	if err := t.Tx.Commit(); err != nil {
		return err
	}
	t.h.commits.Add(1)
	return nil
}

// applyEffectOnAnyTx is applyEffect for a transaction that a test wraps, which
// processor.TxFromContext does not return.
func applyEffectOnAnyTx(ctx context.Context, msg *messagedata.MessageData) error {
	tx, ok := middleware.CurrentTx(ctx)
	if !ok {
		return errors.New("no transaction")
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO effects (message_id, note) VALUES (?, ?)`), msg.ID, string(msg.Payload))
	return err
}

func TestGroupCommit_ConcurrentDeliveriesShareOneCommitAndNoneIsAckedBeforeIt(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		const n = 8
		store, err := dedup.New(f.db, dedup.Config{})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(context.Background()))
		held := &heldDB{db: f.db, committing: make(chan struct{}), release: make(chan struct{})}
		// The group starts once all n deliveries have joined it (it is full), never by waiting.
		heldGroupCommit := onceflow.UseFactory("held-group-commit", func(h onceflow.HandlerInfo) (middleware.Middleware, error) {
			return groupcommit.New(groupcommit.Config{DB: held, Store: store, Handler: h.Name, MaxSize: n, MaxWait: time.Minute})
		})
		f.startRouter(t, onceflow.Handler{
			// Group commit of its own records the ids: the built-in duplicate detection goes.
			Chain: onceflow.ExactlyOnce.Chain().Replace(onceflow.StageTransaction, heldGroupCommit).
				Remove(onceflow.StageDeduplicate, onceflow.AppliedTwice),
			Concurrency: n,
			Processor:   processor.Func(applyEffectOnAnyTx),
		})

		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("g-%d", i)
			f.publish(t, ids[i], "x")
		}
		<-held.committing
		require.Equal(t, 0, f.broker.TotalAcks(), "a message was acked before its group committed")
		close(held.release)
		for _, id := range ids {
			f.waitAcks(t, id, 1)
			require.Equal(t, 1, countEffects(t, f.db, id))
			require.Equal(t, 1, countDedup(t, f.db, id))
			require.Equal(t, 0, f.broker.Nacks(id))
		}
		require.Equal(t, int32(1), held.commits.Load(), "one commit for the whole group")
	})
}

func TestGroupCommit_AtLeastOnceGroupsWithoutADedupTable(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.startRouter(t, onceflow.Handler{QoS: onceflow.AtLeastOnce, Concurrency: 4, GroupCommit: onceflow.GroupCommitConfig{}})
		for i := range 4 {
			f.publish(t, fmt.Sprintf("a-%d", i), "x")
		}
		for i := range 4 {
			f.waitAcks(t, fmt.Sprintf("a-%d", i), 1)
			require.Equal(t, 1, countEffects(t, f.db, fmt.Sprintf("a-%d", i)))
		}
		var n int
		require.Error(t, f.db.Get(&n, `SELECT COUNT(*) FROM onceflow_dedup`), "no dedup table for at-least-once")
	})
}

// addProbe adds to r a handler of topic "probe" that touches no database, so that a test can
// tell when r refuses new deliveries because it is closing.
func addProbe(t *testing.T, r *onceflow.Router, b *brokertest.Broker, db *sqldb.DB) {
	t.Helper()
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "probe", Topic: "probe", Subscriber: b.Subscriber(), DB: db,
		Chain:     onceflow.BestEffort.Chain().Remove(onceflow.StageTransaction, onceflow.PartlyApplied),
		Processor: processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }),
	}))
}

// waitClosing returns once the router refuses new deliveries: a probe it nacks.
func waitClosing(t *testing.T, b *brokertest.Broker) {
	t.Helper()
	testsvc.Eventually(t, 10*time.Second, func() bool {
		require.NoError(t, b.Publish("probe", message.NewMessage("probe", nil)))
		return b.Nacks("probe") > 0
	}, "the router did not start closing")
}

func TestGroupCommit_CloseLetsAGroupInFlightCommitAndAck(t *testing.T) {
	db := testsvc.SQLite(t)
	createEffects(t, db)
	b := brokertest.New()
	defer b.Close()
	entered := make(chan struct{})
	proceed := make(chan struct{})
	var first sync.Once
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: -1, CloseTimeout: 10 * time.Second})
	require.NoError(t, err)
	// Both messages are in the group, which waits for nothing else.
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: b.Subscriber(), DB: db, QoS: onceflow.ExactlyOnce,
		Concurrency: 2, GroupCommit: onceflow.GroupCommitConfig{MaxSize: 2, MaxWait: time.Minute},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			first.Do(func() {
				close(entered)
				<-proceed
			})
			return applyEffect(ctx, msg)
		}),
	}))
	addProbe(t, r, b, db)
	stop := runRouter(t, r)
	f := &fixture{db: db, broker: b}
	f.publish(t, "a", "x")
	f.publish(t, "b", "x")
	<-entered

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	waitClosing(t, b)
	select {
	case err := <-stopped:
		t.Fatalf("Close returned while a group was in flight: %v", err)
	default:
	}
	close(proceed)
	require.NoError(t, <-stopped)

	for _, id := range []string{"a", "b"} {
		require.Equal(t, 1, b.Acks(id), id)
		require.Equal(t, 0, b.Nacks(id), id)
		require.Equal(t, 1, countEffects(t, db, id), id)
	}
}

func TestGroupCommit_CloseNeverAcksAGroupThatDidNotCommit(t *testing.T) {
	db := testsvc.SQLite(t)
	createEffects(t, db)
	b := brokertest.New()
	defer b.Close()
	entered := make(chan struct{})
	var first sync.Once
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: -1, CloseTimeout: 50 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: b.Subscriber(), DB: db, QoS: onceflow.ExactlyOnce,
		Concurrency: 2, GroupCommit: onceflow.GroupCommitConfig{MaxSize: 2, MaxWait: time.Minute},
		Retry: middleware.Retry{MaxAttempts: 1},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if err := applyEffect(ctx, msg); err != nil {
				return err
			}
			first.Do(func() { close(entered) })
			<-ctx.Done() // outlives the close timeout; the subscription's end cancels it
			return ctx.Err()
		}),
	}))
	stop := runRouter(t, r)
	f := &fixture{db: db, broker: b}
	f.publish(t, "a", "x")
	f.publish(t, "b", "x")
	<-entered

	require.NoError(t, stop())

	for _, id := range []string{"a", "b"} {
		require.Equal(t, 0, b.Acks(id), id)
		require.Equal(t, 0, countEffects(t, db, id), id)
		require.Equal(t, 0, countDedup(t, db, id), id)
	}
	var back []string
	testsvc.Eventually(t, 10*time.Second, func() bool {
		for _, m := range b.Drain(topic) {
			back = append(back, m.UUID)
		}
		return len(back) >= 2
	}, "the broker does not have both messages back")
	require.ElementsMatch(t, []string{"a", "b"}, back)
}

func TestGroupCommit_InvalidHandlerConfigurationIsAnError(t *testing.T) {
	db := testsvc.SQLite(t)
	b := brokertest.New()
	defer b.Close()
	base := onceflow.Handler{Name: "h", Topic: topic, Subscriber: b.Subscriber(), DB: db, Processor: processor.Func(applyEffect)}
	for name, tc := range map[string]struct {
		edit func(*onceflow.Handler)
		want string
	}{
		"with check-first": {func(h *onceflow.Handler) {
			h.QoS = onceflow.ExactlyOnce
			h.Processor, h.BatchProcessor = nil, processor.BatchFunc(func(context.Context, []*messagedata.MessageData) error { return nil })
			h.Dedup.Mode = middleware.DedupCheckFirst
		}, "Handler.Dedup.Mode: DedupCheckFirst is not supported with group commit"},
		"sizes with check-first": {func(h *onceflow.Handler) {
			h.QoS = onceflow.ExactlyOnce
			h.Dedup.Mode = middleware.DedupCheckFirst
			h.GroupCommit.MaxSize = 8
		}, "Handler.GroupCommit.MaxSize: set, but group commit is off: the handler's Dedup.Mode, DedupCheckFirst, gives each message a transaction of its own"},
		"disabled without the transaction stage": {func(h *onceflow.Handler) {
			h.Chain = onceflow.AtLeastOnce.Chain().Replace(onceflow.StageTransaction, onceflow.Use("mine", middleware.Recover()))
			h.GroupCommit.Disabled = true
		}, `Handler.GroupCommit.Disabled: set, but the chain's transaction stage is "mine", a stage of one's own`},
		"disabled with a batch processor": {func(h *onceflow.Handler) {
			h.QoS = onceflow.ExactlyOnce
			h.Processor, h.BatchProcessor = nil, processor.BatchFunc(func(context.Context, []*messagedata.MessageData) error { return nil })
			h.GroupCommit.Disabled = true
		}, "Handler.GroupCommit.Disabled: set with a BatchProcessor"},
		"negative size": {func(h *onceflow.Handler) {
			h.QoS = onceflow.ExactlyOnce
			h.GroupCommit = onceflow.GroupCommitConfig{MaxSize: -1}
		}, "Handler.GroupCommit.MaxSize"},
		"negative wait": {func(h *onceflow.Handler) {
			h.QoS = onceflow.ExactlyOnce
			h.GroupCommit = onceflow.GroupCommitConfig{MaxWait: -time.Millisecond}
		}, "Handler.GroupCommit.MaxWait"},
		"sizes without group commit": {func(h *onceflow.Handler) {
			h.QoS = onceflow.ExactlyOnce
			h.GroupCommit = onceflow.GroupCommitConfig{Disabled: true, MaxSize: 8}
		}, "Handler.GroupCommit.MaxSize: set, but group commit is off: GroupCommit.Disabled is set"},
		"store without batches": {func(h *onceflow.Handler) {
			h.QoS = onceflow.ExactlyOnce
			h.Dedup.Store = recordOnlyStore{}
		}, "Handler.Dedup.Store"},
	} {
		t.Run(name, func(t *testing.T) {
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: -1})
			require.NoError(t, err)
			h := base
			tc.edit(&h)
			require.ErrorContains(t, r.AddHandler(h), tc.want)
		})
	}
}

// recordOnlyStore is a dedup.Store that cannot record a group's keys at once.
type recordOnlyStore struct{}

func (recordOnlyStore) Record(context.Context, sqlx.ExtContext, dedup.Key, string) (bool, error) {
	return true, nil
}

func (recordOnlyStore) Lookup(context.Context, sqlx.ExtContext, dedup.Key) (string, bool, error) {
	return "", false, nil
}

// windowSubscriber records the window each of its subscriptions is asked for
// (redelivery.WithWindow).
type windowSubscriber struct {
	message.Subscriber
	mu      sync.Mutex
	windows []int
}

func (s *windowSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.mu.Lock()
	s.windows = append(s.windows, redelivery.WindowFrom(ctx, 0, 0))
	s.mu.Unlock()
	return s.Subscriber.Subscribe(ctx, topic)
}

// The router asks each subscription for what its handler can take at once, so that a
// subscriber whose prefetch is left unset keeps the handler busy: with group commit, a full
// group running and the next collecting (twice GroupCommit.MaxSize); without, one delivery.
func TestRouter_AsksEachSubscriptionForWhatTheHandlerTakesAtOnce(t *testing.T) {
	for _, c := range []struct {
		name  string
		group onceflow.GroupCommitConfig
		want  int
	}{
		{"group commit", onceflow.GroupCommitConfig{}, 2 * groupcommit.DefaultMaxSize},
		{"group commit of 10", onceflow.GroupCommitConfig{MaxSize: 10}, 20},
		{"transaction per message", onceflow.GroupCommitConfig{Disabled: true}, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, testsvc.Databases()[0])
			sub := &windowSubscriber{Subscriber: f.broker.Subscriber()}
			f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce, Subscriber: sub, Concurrency: 16, GroupCommit: c.group})
			sub.mu.Lock()
			defer sub.mu.Unlock()
			require.Equal(t, slices.Repeat([]int{c.want}, 16), sub.windows)
		})
	}
}
