package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/sqldb"
)

func TestPublish_CommittedMessagesAreRelayedWithIDPayloadMetadataAndTraceContext(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
		ctx, span := tp.Tracer("test").Start(context.Background(), "process order-1")
		traced := message.NewMessage(outbox.DerivedID("order-1", "shipped"), []byte(`{"order":1}`))
		traced.Metadata.Set("tenant", "acme")
		binary := message.NewMessage(outbox.DerivedID("order-1", "label"), []byte{0, 1, 0xfe, 0xff})
		require.NoError(t, e.process(ctx, "order-1", nil, traced, binary))
		span.End()
		untraced := message.NewMessage(outbox.DerivedID("order-2", "shipped"), []byte(`{"order":2}`))
		require.NoError(t, e.process(context.Background(), "order-2", nil, untraced))

		_, touched := traced.Metadata["traceparent"]
		require.False(t, touched, "Publish must not change the caller's message")

		rec := newRecorder()
		start(t, relayConfig(e, e.db, rec))
		got := rec.waitFor(t, 3)

		traceparent := fmt.Sprintf("00-%s-%s-01", span.SpanContext().TraceID(), span.SpanContext().SpanID())
		require.Len(t, got, 3)
		for _, s := range got {
			require.Equal(t, topic, s.topic)
		}
		require.Equal(t, traced.UUID, got[0].msg.UUID)
		require.Equal(t, []byte(`{"order":1}`), []byte(got[0].msg.Payload))
		require.Equal(t, message.Metadata{"tenant": "acme", "traceparent": traceparent}, got[0].msg.Metadata)
		require.Equal(t, binary.UUID, got[1].msg.UUID)
		require.Equal(t, []byte{0, 1, 0xfe, 0xff}, []byte(got[1].msg.Payload))
		require.Equal(t, message.Metadata{"traceparent": traceparent}, got[1].msg.Metadata)
		require.Equal(t, untraced.UUID, got[2].msg.UUID)
		require.Empty(t, got[2].msg.Metadata)
	})
}

func TestPublish_RolledBackMessagesAreNeverRelayed(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		boom := errors.New("boom")
		rolledBack := message.NewMessage(outbox.DerivedID("order-1", "shipped"), []byte("rolled back"))
		require.ErrorIs(t, e.process(context.Background(), "order-1", boom, rolledBack), boom)
		after := e.commitN(t, "order", 2)

		st, err := e.ob.Stats(context.Background(), "")
		require.NoError(t, err)
		require.Equal(t, int64(2), st.Backlog)

		rec := newRecorder()
		r := start(t, relayConfig(e, e.db, rec))
		rec.waitFor(t, 2)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))
		// The relay sends in order: once the messages committed after it are sent, the rolled
		// back one would have been sent too.
		require.Equal(t, after, rec.ids())
	})
}

func TestPublish_WithoutTransactionFails(t *testing.T) {
	t.Parallel()
	db := testsvc.SQLite(t)
	ob, err := outbox.New(db, outbox.Config{})
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(context.Background()))

	err = ob.Publish(context.Background(), topic, message.NewMessage("id-1", nil))
	require.ErrorIs(t, err, outbox.ErrNoTransaction)
	require.ErrorContains(t, err, "outbox: Publish: no transaction in the context")

	st, err := ob.Stats(context.Background(), "")
	require.NoError(t, err)
	require.Zero(t, st.Backlog)
}

func TestPublish_RefusesInvalidMessagesBeforeWriting(t *testing.T) {
	t.Parallel()
	db := testsvc.SQLite(t)
	ob, err := outbox.New(db, outbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, ob.Migrate(ctx))
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback()

	ok := message.NewMessage("id-1", nil)
	require.ErrorContains(t, ob.PublishTx(ctx, tx, "", ok), "destination topic is empty")
	require.ErrorContains(t, ob.PublishTx(ctx, tx, topic, ok, nil), "message 1 of 2 is nil")
	require.ErrorContains(t, ob.PublishTx(ctx, tx, topic, ok, message.NewMessage("", nil)), "message 1 of 2 has no UUID")
	require.NoError(t, ob.PublishTx(ctx, tx, topic))
	require.NoError(t, tx.Commit())

	st, err := ob.Stats(ctx, "")
	require.NoError(t, err)
	require.Zero(t, st.Backlog)
}

func TestPublish_ManyMessagesInOneCallAreAllWritten(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		msgs := make([]*message.Message, 2500)
		for i := range msgs {
			msgs[i] = message.NewMessage(outbox.DerivedID("order-1", fmt.Sprint(i)), []byte("x"))
		}
		require.NoError(t, e.process(context.Background(), "order-1", nil, msgs...))
		st, err := e.ob.Stats(context.Background(), "")
		require.NoError(t, err)
		require.Equal(t, int64(2500), st.Backlog)
	})
}

func TestStats_CountsBacklogAndLagUntilRelayed(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ctx := context.Background()
		st, err := e.ob.Stats(ctx, "")
		require.NoError(t, err)
		require.Equal(t, outbox.Stats{}, st)

		before := time.Now()
		e.commitN(t, "order", 3)
		after := time.Now()

		st, err = e.ob.Stats(ctx, "")
		require.NoError(t, err)
		require.Equal(t, int64(3), st.Backlog)
		// The database's clock is this machine's; allow for its rounding.
		require.WithinRange(t, st.OldestUnsent, before.Add(-time.Second), after.Add(time.Second))
		// The lag is the oldest message's age now, by the same clock.
		require.GreaterOrEqual(t, st.Lag, time.Duration(0))
		require.WithinRange(t, st.OldestUnsent.Add(st.Lag), before.Add(-time.Second), time.Now().Add(time.Second))

		rec := newRecorder()
		r := start(t, relayConfig(e, e.db, rec))
		rec.waitFor(t, 3)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		st, err = r.Stats(ctx)
		require.NoError(t, err)
		require.Equal(t, outbox.Stats{}, st)

		// A group that has never run has sent nothing.
		st, err = e.ob.Stats(ctx, "audit")
		require.NoError(t, err)
		require.Equal(t, int64(3), st.Backlog)
	})
}

func TestMigrate_IsIdempotentAndSafeConcurrently(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			ob, err := outbox.New(db, outbox.Config{Table: "events_outbox"})
			require.NoError(t, err)
			var wg sync.WaitGroup
			errs := make([]error, 4)
			for i := range errs {
				wg.Go(func() { errs[i] = ob.Migrate(context.Background()) })
			}
			wg.Wait()
			require.NoError(t, errors.Join(errs...))
			require.NoError(t, ob.Migrate(context.Background()))

			messages, offsets := ob.Tables()
			leases := "events_outbox_leases"
			if db.Dialect == sqldb.SQLite {
				leases = "onceflow_leases_events_outbox"
			}
			for _, table := range []string{messages, offsets, leases} {
				var n int
				require.NoError(t, db.QueryRow(`SELECT COUNT(*) FROM `+db.Dialect.Quote(table)).Scan(&n), table)
			}
			if db.Dialect == sqldb.SQLite {
				require.Equal(t, []string{"onceflow_queue_events_outbox", "onceflow_offsets_events_outbox"}, []string{messages, offsets})
			} else {
				require.Equal(t, []string{"events_outbox", "events_outbox_offsets"}, []string{messages, offsets})
			}
		})
	}
}

func TestPurge_DeletesOnlyWhatEveryGroupHasSent(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ctx := context.Background()
		ids := e.commitN(t, "order", 10)

		res, err := e.ob.Purge(ctx, outbox.PurgeOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(0), res.Deleted, "no group is registered: nothing may go")

		// Group "fast" sends everything.
		fast := newRecorder()
		cfg := relayConfig(e, e.db, fast)
		cfg.ConsumerGroup = "fast"
		r := start(t, cfg)
		fast.waitFor(t, 10)
		waitBacklog(t, e.ob, "fast", 0)
		require.NoError(t, r.stop(t))

		// Group "slow" sends all but the sixth, which its destination keeps failing.
		var broken atomic.Bool
		broken.Store(true)
		slow := newRecorder()
		slow.before = func(m *message.Message, _ int) error {
			if m.UUID == ids[5] && broken.Load() {
				return errors.New("destination refuses it for now")
			}
			return nil
		}
		cfg = relayConfig(e, e.db, slow)
		cfg.ConsumerGroup = "slow"
		cfg.MaxAttempts = 1000
		r = start(t, cfg)
		slow.waitFor(t, 9)
		waitBacklog(t, e.ob, "slow", 1)

		// Every row before the last one the cursors passed, except the sixth, which "slow"
		// holds: eight rows.
		res, err = e.ob.Purge(ctx, outbox.PurgeOptions{BatchSize: 3})
		require.NoError(t, err)
		require.Equal(t, outbox.PurgeResult{Deleted: 8, Batches: 3}, res)
		res, err = e.ob.Purge(ctx, outbox.PurgeOptions{})
		require.NoError(t, err)
		require.Equal(t, outbox.PurgeResult{Deleted: 0, Batches: 1}, res)
		for group, want := range map[string]int64{"fast": 0, "slow": 1} {
			st, err := e.ob.Stats(ctx, group)
			require.NoError(t, err)
			require.Equal(t, want, st.Backlog, group)
		}

		// The destination takes it at last; then it goes too.
		broken.Store(false)
		slow.waitFor(t, 10)
		waitBacklog(t, e.ob, "slow", 0)
		require.NoError(t, r.stop(t))
		require.Equal(t, append(append(ids[:5:5], ids[6:]...), ids[5]), slow.ids())
		res, err = e.ob.Purge(ctx, outbox.PurgeOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(1), res.Deleted)
		require.Equal(t, 1, e.rows(t), "the last row a cursor passed is kept")
	})
}

func TestConfig_ValidateNamesTheTable(t *testing.T) {
	t.Parallel()
	require.NoError(t, outbox.Config{}.Validate())
	require.NoError(t, outbox.Config{Table: strings.Repeat("a", outbox.MaxTableLen)}.Validate())
	for _, table := range []string{"bad-name", "1abc", "a b", `x"; DROP TABLE y; --`, strings.Repeat("a", outbox.MaxTableLen+1)} {
		err := outbox.Config{Table: table}.Validate()
		require.Error(t, err, table)
		require.True(t, strings.HasPrefix(err.Error(), "Table: "), err.Error())
	}
	_, err := outbox.New(nil, outbox.Config{})
	require.ErrorContains(t, err, "db is nil")
}

func TestDerivedID_IsStableAndDistinct(t *testing.T) {
	t.Parallel()
	a := outbox.DerivedID("order-1", "shipped")
	require.Equal(t, a, outbox.DerivedID("order-1", "shipped"))
	require.Len(t, a, 36)
	seen := map[string]bool{a: true}
	for _, args := range [][2]string{{"order-1", "invoice"}, {"order-2", "shipped"}, {"order-1shipped", ""}, {"order-", "1shipped"}} {
		id := outbox.DerivedID(args[0], args[1])
		require.False(t, seen[id], "%v", args)
		seen[id] = true
	}
}
