package groupcommit_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/groupcommit"
	"github.com/onceflow/onceflow/internal/memtx"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// countingDB is a Beginner that counts transactions and commits, and can hold or fail a
// commit.
type countingDB struct {
	db         *sqldb.DB
	begins     atomic.Int32
	commits    atomic.Int32
	savepoints atomic.Int32
	// beforeCommit, when set, runs before each COMMIT; an error it returns rolls the
	// transaction back and is returned by Commit instead.
	beforeCommit func() error
}

func (c *countingDB) BeginTx(ctx context.Context, opts *sql.TxOptions) (middleware.Tx, error) {
	tx, err := c.db.BeginTxx(ctx, opts)
	if err != nil {
		return nil, err
	}
	c.begins.Add(1)
	return &countingTx{Tx: tx, db: c}, nil
}

type countingTx struct {
	*sqlx.Tx
	db *countingDB
}

func (t *countingTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if strings.HasPrefix(query, "SAVEPOINT") {
		t.db.savepoints.Add(1)
	}
	return t.Tx.ExecContext(ctx, query, args...)
}

func (t *countingTx) Commit() error {
	if t.db.beforeCommit != nil {
		if err := t.db.beforeCommit(); err != nil {
			_ = t.Tx.Rollback()
			return err
		}
	}
	if err := t.Tx.Commit(); err != nil {
		return err
	}
	t.db.commits.Add(1)
	return nil
}

// groupFixture is a database with a business table gc_effects (one row per applied effect,
// no unique key) and a migrated dedup store.
type groupFixture struct {
	db    *sqldb.DB
	cdb   *countingDB
	store *dedup.SQLStore
}

func newGroupFixture(t *testing.T, d testsvc.Database) *groupFixture {
	t.Helper()
	db := d.Open(t)
	_, err := db.Exec(`CREATE TABLE gc_effects (id VARCHAR(255) NOT NULL)`)
	require.NoError(t, err)
	store, err := dedup.New(db, dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	return &groupFixture{db: db, cdb: &countingDB{db: db}, store: store}
}

func (f *groupFixture) effects(t *testing.T, id string) int {
	t.Helper()
	var n int
	require.NoError(t, f.db.Get(&n, f.db.Rebind(`SELECT COUNT(*) FROM gc_effects WHERE id = ?`), id))
	return n
}

func (f *groupFixture) recorded(t *testing.T, id string) int {
	t.Helper()
	var n int
	require.NoError(t, f.db.Get(&n, f.db.Rebind(`SELECT COUNT(*) FROM onceflow_dedup WHERE message_id = ?`), id))
	return n
}

// insertEffect writes the message's effect row through the group's transaction.
func insertEffect(ctx context.Context, msg *messagedata.MessageData) error {
	tx, ok := middleware.CurrentTx(ctx)
	if !ok {
		return errors.New("no transaction")
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO gc_effects (id) VALUES (?)`), msg.ID)
	return err
}

// outcome is what one Process call gave: its error, or the value it panicked with.
type outcome struct {
	err   error
	panic any
}

// processAll runs p for every id at once, each in its own goroutine as the router would, and
// returns the outcomes in the order of ids.
func processAll(p processor.Processor, ids ...string) []outcome {
	out := make([]outcome, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() {
			defer func() { out[i].panic = recover() }()
			out[i].err = p.Process(context.Background(), msg(id))
		})
	}
	wg.Wait()
	return out
}

func forEachDB(t *testing.T, fn func(t *testing.T, d testsvc.Database)) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			fn(t, d)
		})
	}
}

// groupCommit builds GroupCommit on f for groups of n: a group starts when all n have joined,
// never by MaxWait.
func (f *groupFixture) groupCommit(t *testing.T, n int, p processor.Processor, opts ...option) processor.Processor {
	t.Helper()
	opts = append([]option{maxSize(n), maxWait(time.Hour)}, opts...)
	mw, err := newGroupCommit(f.cdb, f.store, "h", opts...)
	require.NoError(t, err)
	return mw(p)
}

func TestGroupCommit_ConcurrentMessagesShareOneTransactionAndOneCommit(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		var txs sync.Map // transaction -> members that saw it
		p := f.groupCommit(t, 8, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			tx, _ := middleware.CurrentTx(ctx)
			n, _ := txs.LoadOrStore(tx, new(atomic.Int32))
			n.(*atomic.Int32).Add(1)
			return insertEffect(ctx, m)
		}))

		ids := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
		for i, o := range processAll(p, ids...) {
			require.NoError(t, o.err, ids[i])
			require.Nil(t, o.panic)
		}

		require.Equal(t, int32(1), f.cdb.begins.Load())
		require.Equal(t, int32(1), f.cdb.commits.Load())
		members := 0
		txs.Range(func(_, n any) bool { members += int(n.(*atomic.Int32).Load()); return true })
		require.Equal(t, 8, members)
		for _, id := range ids {
			require.Equal(t, 1, f.effects(t, id), id)
			require.Equal(t, 1, f.recorded(t, id), id)
		}
	})
}

func TestGroupCommit_NoMemberReturnsBeforeTheCommit(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		committing := make(chan struct{})
		release := make(chan struct{})
		f.cdb.beforeCommit = func() error {
			close(committing)
			<-release
			return nil
		}
		p := f.groupCommit(t, 4, processor.Func(insertEffect))

		var returned atomic.Int32
		done := make(chan []outcome)
		go func() {
			out := processAll(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
				err := p.Process(ctx, m)
				returned.Add(1)
				return err
			}), "a", "b", "c", "d")
			done <- out
		}()
		<-committing
		require.Equal(t, int32(0), returned.Load(), "a member returned while its commit was still in flight")
		close(release)
		for _, o := range <-done {
			require.NoError(t, o.err)
		}
		require.Equal(t, int32(4), returned.Load())
		require.Equal(t, int32(1), f.cdb.commits.Load())
	})
}

func TestGroupCommit_FailingMemberRollsBackAloneAndItsRedeliveryAppliesOnce(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		boom := errors.New("downstream service unavailable")
		var failed atomic.Bool
		p := f.groupCommit(t, 3, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			if err := insertEffect(ctx, m); err != nil {
				return err
			}
			if m.ID == "bad" && failed.CompareAndSwap(false, true) {
				return boom // after writing: the write must be rolled back with the id
			}
			return nil
		}))

		out := processAll(p, "ok-1", "bad", "ok-2")
		require.NoError(t, out[0].err)
		require.ErrorIs(t, out[1].err, boom)
		require.NotErrorIs(t, out[1].err, middleware.ErrGroupAborted)
		require.NoError(t, out[2].err)
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Equal(t, 1, f.effects(t, "ok-1"))
		require.Equal(t, 1, f.effects(t, "ok-2"))
		require.Equal(t, 0, f.effects(t, "bad"))
		require.Equal(t, 0, f.recorded(t, "bad"), "the failed member's id is forgotten, so that its redelivery is new")

		// The redelivery, in a group of its own, is processed and applied once.
		solo := f.groupCommit(t, 1, processor.Func(insertEffect))
		require.NoError(t, solo.Process(context.Background(), msg("bad")))
		require.Equal(t, 1, f.effects(t, "bad"))
		require.Equal(t, 1, f.recorded(t, "bad"))
	})
}

func TestGroupCommit_MemberFailingWithSQLErrorDoesNotSpoilTheOthers(t *testing.T) {
	// On PostgreSQL a failed statement aborts the transaction: only the member's savepoint
	// keeps the others alive.
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		_, err := f.db.Exec(`CREATE TABLE gc_payments (id VARCHAR(64) PRIMARY KEY)`)
		require.NoError(t, err)
		_, err = f.db.Exec(`INSERT INTO gc_payments (id) VALUES ('taken')`)
		require.NoError(t, err)
		p := f.groupCommit(t, 3, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			if err := insertEffect(ctx, m); err != nil {
				return err
			}
			tx, _ := middleware.CurrentTx(ctx)
			payment := m.ID
			if m.ID == "clash" {
				payment = "taken"
			}
			_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO gc_payments (id) VALUES (?)`), payment)
			return err
		}))

		out := processAll(p, "pay-1", "clash", "pay-2")
		require.NoError(t, out[0].err)
		require.True(t, sqldb.IsUniqueViolation(out[1].err), "want a unique violation, got %v", out[1].err)
		require.NoError(t, out[2].err)
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Equal(t, 1, f.effects(t, "pay-1"))
		require.Equal(t, 1, f.effects(t, "pay-2"))
		require.Equal(t, 0, f.effects(t, "clash"))
		require.Equal(t, 0, f.recorded(t, "clash"))
		var payments int
		require.NoError(t, f.db.Get(&payments, `SELECT COUNT(*) FROM gc_payments`))
		require.Equal(t, 3, payments)
	})
}

func TestGroupCommit_MemberThatEndsTheTransactionFailsAloneAndTheOthersCommit(t *testing.T) {
	// What a MySQL deadlock does: the server rolls the whole transaction back. The group runs
	// again without the member, and the others commit.
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		p := f.groupCommit(t, 3, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			if err := insertEffect(ctx, m); err != nil {
				return err
			}
			if m.ID == "spoiler" {
				tx, _ := middleware.CurrentTx(ctx)
				_ = tx.Rollback()
				return errors.New("deadlock found when trying to get lock")
			}
			return nil
		}))

		out := processAll(p, "a", "spoiler", "b")
		require.ErrorContains(t, out[1].err, "deadlock")
		require.NoError(t, out[0].err)
		require.NoError(t, out[2].err)
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Equal(t, 1, f.effects(t, "a"))
		require.Equal(t, 1, f.effects(t, "b"))
		require.Equal(t, 0, f.effects(t, "spoiler"))
		require.Equal(t, 0, f.recorded(t, "spoiler"))
	})
}

func TestGroupCommit_MemberThatEndsTheTransactionAfterAFailureAbortsTheRestRetryably(t *testing.T) {
	// Once a member has failed, the others run under savepoints; one that then ends the
	// transaction takes the savepoints with it, and the rest cannot commit.
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		boom := errors.New("boom")
		p, ordered := f.orderedGroup(t, 3, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			if err := insertEffect(ctx, m); err != nil {
				return err
			}
			switch m.ID {
			case "first-failure":
				return boom
			case "spoiler":
				tx, _ := middleware.CurrentTx(ctx)
				_ = tx.Rollback()
				return errors.New("deadlock found when trying to get lock")
			}
			return nil
		}))

		out := ordered(p, "first-failure", "spoiler", "b")
		require.ErrorIs(t, out[0].err, boom)
		require.ErrorContains(t, out[1].err, "deadlock")
		require.ErrorIs(t, out[2].err, middleware.ErrGroupAborted)
		require.Equal(t, processor.Failed, processor.OutcomeOf(out[2].err), "retried, not acked")
		require.Zero(t, f.cdb.commits.Load())
		for _, id := range []string{"first-failure", "spoiler", "b"} {
			require.Equal(t, 0, f.effects(t, id), id)
			require.Equal(t, 0, f.recorded(t, id), id)
		}
	})
}

// orderedGroup builds GroupCommit on f for groups of n, and a function that processes ids with
// p, each in its own goroutine, joining the group in the order given: a group runs its members
// in the order they joined.
func (f *groupFixture) orderedGroup(t *testing.T, n int, p processor.Processor, opts ...option) (processor.Processor, func(processor.Processor, ...string) []outcome) {
	t.Helper()
	joined := make(chan int, n)
	opts = append(opts, onJoin(func(size int) { joined <- size }))
	gc := f.groupCommit(t, n, p, opts...)
	return gc, func(p processor.Processor, ids ...string) []outcome {
		out := make([]outcome, len(ids))
		var wg sync.WaitGroup
		for i, id := range ids {
			wg.Go(func() {
				defer func() { out[i].panic = recover() }()
				out[i].err = p.Process(context.Background(), msg(id))
			})
			<-joined
		}
		wg.Wait()
		return out
	}
}

func TestGroupCommit_EachMemberGetsDedupAndCommitSpansWithTheGroupSize(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	gc := f.groupCommit(t, 2, processor.Func(insertEffect))
	p := middleware.Tracing{TracerProvider: tp}.Middleware("h")(gc)

	for _, o := range processAll(p, "a", "b") {
		require.NoError(t, o.err)
	}

	children := map[trace.SpanID][]sdktrace.ReadOnlySpan{}
	var consumers []sdktrace.ReadOnlySpan
	for _, s := range spans.Ended() {
		if s.SpanKind() == trace.SpanKindConsumer {
			consumers = append(consumers, s)
		} else {
			children[s.Parent().SpanID()] = append(children[s.Parent().SpanID()], s)
		}
	}
	require.Len(t, consumers, 2)
	for _, c := range consumers {
		var names []string
		for _, s := range children[c.SpanContext().SpanID()] {
			names = append(names, s.Name())
			if s.Name() == "onceflow.commit" {
				require.Contains(t, s.Attributes(), telemetry.AttrGroupSize.Int(2))
			}
		}
		require.ElementsMatch(t, []string{"onceflow.dedup", "onceflow.commit"}, names)
	}
}

func TestGroupCommit_PanicIsRaisedInTheMembersGoroutineAndRollsBackOnlyThatMember(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		p := middleware.Recover()(f.groupCommit(t, 3, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			if err := insertEffect(ctx, m); err != nil {
				return err
			}
			if m.ID == "bug" {
				panicInProcessor()
			}
			return nil
		})))

		out := processAll(p, "ok-1", "bug", "ok-2")
		require.NoError(t, out[0].err)
		require.NoError(t, out[2].err)
		require.Nil(t, out[1].panic, "Recover, in the member's goroutine, caught it")
		var pe *processor.PanicError
		require.ErrorAs(t, out[1].err, &pe)
		require.Equal(t, "bug in processor", pe.Value, "the value of the original panic, not a wrapper")
		require.Contains(t, string(pe.Stack), "panicInProcessor", "the stack of the original panic")
		require.Equal(t, processor.Panicked, processor.OutcomeOf(out[1].err))
		require.Equal(t, 1, f.effects(t, "ok-1"))
		require.Equal(t, 1, f.effects(t, "ok-2"))
		require.Equal(t, 0, f.effects(t, "bug"))
		require.Equal(t, 0, f.recorded(t, "bug"))
		require.Equal(t, int32(1), f.cdb.commits.Load())
	})
}

func panicInProcessor() { panic("bug in processor") }

func TestGroupCommit_PanicWithoutRecoverPanicsInTheMembersGoroutine(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	p := f.groupCommit(t, 2, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		if m.ID == "bug" {
			panic("bug in processor")
		}
		return insertEffect(ctx, m)
	}))

	out := processAll(p, "ok", "bug")
	require.NoError(t, out[0].err)
	require.Nil(t, out[0].panic)
	pe, ok := out[1].panic.(*processor.PanicError)
	require.True(t, ok, "panic value %T", out[1].panic)
	require.Equal(t, "bug in processor", pe.Value)
	require.Equal(t, 1, f.effects(t, "ok"))
}

func TestGroupCommit_RecordedIDIsDuplicateAndNotProcessed(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		var calls sync.Map
		proc := processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			n, _ := calls.LoadOrStore(m.ID, new(atomic.Int32))
			n.(*atomic.Int32).Add(1)
			return insertEffect(ctx, m)
		})
		require.NoError(t, f.groupCommit(t, 1, proc).Process(context.Background(), msg("seen")))

		out := processAll(f.groupCommit(t, 3, proc), "new-1", "seen", "new-2")
		require.NoError(t, out[0].err)
		require.ErrorIs(t, out[1].err, processor.ErrDuplicate)
		require.Equal(t, processor.Duplicate, processor.OutcomeOf(out[1].err))
		require.NoError(t, out[2].err)
		n, _ := calls.Load("seen")
		require.Equal(t, int32(1), n.(*atomic.Int32).Load(), "the duplicate is not processed again")
		require.Equal(t, 1, f.effects(t, "seen"))
		require.Equal(t, 1, f.recorded(t, "seen"))
	})
}

func TestGroupCommit_AGroupOfFirstDeliveriesReadsItsIDsOutcomesOnlyWhenOneIsNotNew(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		ctx := context.Background()
		f := newGroupFixture(t, d)
		proc := processor.Func(insertEffect)
		require.NoError(t, f.groupCommit(t, 1, proc).Process(ctx, msg("seen")))

		// The ids are recorded without reading them back (TryRecordKeys), and one is not
		// new: the transaction runs again and reads each id's outcome.
		begins := f.cdb.begins.Load()
		out := processAll(f.groupCommit(t, 3, proc), "new-1", "seen", "new-2")
		require.NoError(t, out[0].err)
		require.ErrorIs(t, out[1].err, processor.ErrDuplicate)
		require.NoError(t, out[2].err)
		require.Equal(t, int32(2), f.cdb.begins.Load()-begins)

		// A redelivery is likely not new: its group reads the outcomes at once.
		begins = f.cdb.begins.Load()
		again := msg("seen")
		again.Delivery = 2
		p := f.groupCommit(t, 2, proc)
		errs := make(chan error, 2)
		go func() { errs <- p.Process(ctx, again) }()
		go func() { errs <- p.Process(ctx, msg("new-3")) }()
		var dups int
		for range 2 {
			if err := <-errs; err != nil {
				require.ErrorIs(t, err, processor.ErrDuplicate)
				dups++
			}
		}
		require.Equal(t, 1, dups)
		require.Equal(t, int32(1), f.cdb.begins.Load()-begins)

		for _, id := range []string{"seen", "new-1", "new-2", "new-3"} {
			require.Equal(t, 1, f.effects(t, id), id)
			require.Equal(t, 1, f.recorded(t, id), id)
		}
	})
}

func TestGroupCommit_TwoCopiesInOneGroupGiveOneEffect(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		var calls atomic.Int32
		p := f.groupCommit(t, 2, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			calls.Add(1)
			return insertEffect(ctx, m)
		}))

		out := processAll(p, "twin", "twin")
		applied, dup := out[0].err, out[1].err
		if applied != nil {
			applied, dup = dup, applied
		}
		require.NoError(t, applied)
		require.ErrorIs(t, dup, processor.ErrDuplicate)
		require.Equal(t, int32(1), calls.Load())
		require.Equal(t, 1, f.effects(t, "twin"))
	})
}

func TestGroupCommit_CopyOfAFailedMessageInTheSameGroupIsAppliedOnceByTheRerun(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		boom := errors.New("boom")
		var calls atomic.Int32
		proc := processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			if calls.Add(1) == 1 {
				return boom
			}
			return insertEffect(ctx, m)
		})

		out := processAll(f.groupCommit(t, 2, proc), "twin", "twin")
		require.Equal(t, int32(2), calls.Load(), "the copy runs in the group's second transaction")
		var failed, applied error
		if errors.Is(out[0].err, boom) {
			failed, applied = out[0].err, out[1].err
		} else {
			failed, applied = out[1].err, out[0].err
		}
		require.ErrorIs(t, failed, boom)
		require.NoError(t, applied)
		require.Equal(t, 1, f.effects(t, "twin"))
		require.Equal(t, 1, f.recorded(t, "twin"))

		// The failed copy's redelivery finds the id recorded.
		err := f.groupCommit(t, 1, proc).Process(context.Background(), msg("twin"))
		require.ErrorIs(t, err, processor.ErrDuplicate)
		require.Equal(t, 1, f.effects(t, "twin"))
	})
}

func TestGroupCommit_MaxSizeStartsAFullGroup(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	var mu sync.Mutex
	sizes := map[middleware.Tx]int{}
	// No concurrency hint and an hour's wait: only a full group starts.
	mw, err := newGroupCommit(f.cdb, f.store, "h", maxSize(3), maxWait(time.Hour))
	require.NoError(t, err)
	p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		tx, _ := middleware.CurrentTx(ctx)
		mu.Lock()
		sizes[tx]++
		mu.Unlock()
		return insertEffect(ctx, m)
	}))

	for _, o := range processAll(p, "a", "b", "c", "d", "e", "f") {
		require.NoError(t, o.err)
	}
	require.Equal(t, int32(2), f.cdb.commits.Load())
	require.Len(t, sizes, 2)
	for _, n := range sizes {
		require.Equal(t, 3, n)
	}
}

func TestGroupCommit_MaxWaitStartsAGroupThatIsNotFull(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	const wait = 30 * time.Millisecond
	mw, err := newGroupCommit(f.cdb, f.store, "h", maxWait(wait))
	require.NoError(t, err)
	p := mw(processor.Func(insertEffect))

	start := time.Now()
	require.NoError(t, p.Process(context.Background(), msg("alone")))
	require.GreaterOrEqual(t, time.Since(start), wait, "the group waited for more members")
	require.Equal(t, 1, f.effects(t, "alone"))
}

func TestGroupCommit_WithoutMaxWaitMessagesArrivingWhileAGroupRunsFormTheNext(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	joinedNext := make(chan struct{})
	var once sync.Once
	mw, err := newGroupCommit(f.cdb, f.store, "h", maxWait(0),
		onJoin(func(size int) {
			if size == 3 {
				once.Do(func() { close(joinedNext) })
			}
		}))
	require.NoError(t, err)
	var mu sync.Mutex
	sizes := map[middleware.Tx]int{}
	p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		if m.ID == "first" {
			<-joinedNext // the next three join while this group runs
		}
		tx, _ := middleware.CurrentTx(ctx)
		mu.Lock()
		sizes[tx]++
		mu.Unlock()
		return insertEffect(ctx, m)
	}))

	first := make(chan error, 1)
	go func() { first <- p.Process(context.Background(), msg("first")) }()
	for _, o := range processAll(p, "a", "b", "c") {
		require.NoError(t, o.err)
	}
	require.NoError(t, <-first)
	require.Equal(t, int32(2), f.cdb.commits.Load())
	var got []int
	for _, n := range sizes {
		got = append(got, n)
	}
	require.ElementsMatch(t, []int{1, 3}, got)
}

func TestGroupCommit_MemberWhoseContextEndsWhileWaitingLeavesTheGroup(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		joined := make(chan int, 10)
		var calls sync.Map
		// A group starts when it has two members, and never by waiting.
		mw, err := newGroupCommit(f.cdb, f.store, "h", maxSize(2), maxWait(time.Hour),
			onJoin(func(size int) { joined <- size }))
		require.NoError(t, err)
		p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			calls.Store(m.ID, true)
			return insertEffect(ctx, m)
		}))

		ctx, cancel := context.WithCancel(context.Background())
		left := make(chan error, 1)
		go func() { left <- p.Process(ctx, msg("impatient")) }()
		require.Equal(t, 1, <-joined)
		cancel()
		err = <-left
		require.ErrorIs(t, err, context.Canceled)
		require.Equal(t, processor.Failed, processor.OutcomeOf(err))

		// Had it stayed, "b" would fill the group with it and "c" would wait for an hour.
		out := processAll(p, "b", "c")
		require.NoError(t, out[0].err)
		require.NoError(t, out[1].err)
		_, processed := calls.Load("impatient")
		require.False(t, processed)
		require.Equal(t, 0, f.recorded(t, "impatient"))
		require.Equal(t, int32(1), f.cdb.commits.Load())
	})
}

func TestGroupCommit_MemberWhoseContextEndsBeforeItsTurnIsNotProcessedAndItsIDIsForgotten(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		ctxs := map[string]context.Context{}
		cancels := map[string]context.CancelFunc{}
		for _, id := range []string{"x", "y"} {
			ctxs[id], cancels[id] = context.WithCancel(context.Background())
		}
		other := map[string]string{"x": "y", "y": "x"}
		// The member that runs first ends the context of the other, which waits for its turn.
		var mu sync.Mutex
		var ran []string
		p := f.groupCommit(t, 2, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			mu.Lock()
			ran = append(ran, m.ID)
			mu.Unlock()
			if err := insertEffect(ctx, m); err != nil {
				return err
			}
			cancels[other[m.ID]]()
			return nil
		}))
		errs := map[string]error{}
		var wg sync.WaitGroup
		for _, id := range []string{"x", "y"} {
			wg.Go(func() {
				err := p.Process(ctxs[id], msg(id))
				mu.Lock()
				errs[id] = err
				mu.Unlock()
			})
		}
		wg.Wait()

		require.Len(t, ran, 1)
		first, second := ran[0], other[ran[0]]
		require.NoError(t, errs[first])
		require.ErrorIs(t, errs[second], context.Canceled)
		require.Equal(t, 1, f.effects(t, first))
		require.Equal(t, 0, f.effects(t, second))
		require.Equal(t, 1, f.recorded(t, first))
		require.Equal(t, 0, f.recorded(t, second), "the id of the member that never ran is forgotten")
	})
}

func TestGroupCommit_CommitFailureFailsEveryMember(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		for name, tc := range map[string]struct {
			err     error
			unknown bool
		}{
			"connection lost": {driver.ErrBadConn, true},
			"refused":         {errors.New("could not serialize access"), false},
		} {
			t.Run(name, func(t *testing.T) {
				f := newGroupFixture(t, d)
				f.cdb.beforeCommit = func() error { return tc.err }
				out := processAll(f.groupCommit(t, 3, processor.Func(insertEffect)), "a", "b", "c")
				for _, o := range out {
					require.ErrorIs(t, o.err, tc.err)
					require.Equal(t, tc.unknown, errors.Is(o.err, middleware.ErrCommitOutcomeUnknown), "%v", o.err)
					require.Equal(t, processor.Failed, processor.OutcomeOf(o.err))
				}
				require.Equal(t, 0, f.effects(t, "a"))
				require.Equal(t, 0, f.recorded(t, "a"))
			})
		}
	})
}

type failingBeginner struct{ err error }

func (b failingBeginner) BeginTx(context.Context, *sql.TxOptions) (middleware.Tx, error) {
	return nil, b.err
}

func TestGroupCommit_BeginFailureFailsEveryMember(t *testing.T) {
	down := errors.New("database is down")
	mw, err := newGroupCommit(failingBeginner{down}, memGroupStore{}, "h", withConcurrency(2))
	require.NoError(t, err)
	var calls atomic.Int32
	out := processAll(mw(processor.Func(func(context.Context, *messagedata.MessageData) error { calls.Add(1); return nil })), "a", "b")
	for _, o := range out {
		require.ErrorIs(t, o.err, down)
		require.ErrorIs(t, o.err, middleware.ErrGroupAborted)
	}
	require.Zero(t, calls.Load())
}

func TestGroupCommit_InvalidIDFailsOnlyItsMemberPermanently(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		long := strings.Repeat("x", dedup.MaxMessageIDLen+1)
		out := processAll(f.groupCommit(t, 3, processor.Func(insertEffect)), "a", long, "b")
		require.NoError(t, out[0].err)
		require.ErrorIs(t, out[1].err, dedup.ErrKeyTooLong)
		require.True(t, processor.IsPermanent(out[1].err))
		require.NoError(t, out[2].err)
		require.Equal(t, 1, f.effects(t, "a"))
		require.Equal(t, 1, f.effects(t, "b"))
	})
}

func TestGroupCommit_MessageWithoutIDIsRefusedPermanently(t *testing.T) {
	mw, err := newGroupCommit(memtx.DB{}, memGroupStore{}, "h")
	require.NoError(t, err)
	err = mw(processor.Func(func(context.Context, *messagedata.MessageData) error { return nil })).Process(context.Background(), msg(""))
	require.ErrorIs(t, err, messagedata.ErrNoMessageID)
	require.True(t, processor.IsPermanent(err))
}

func TestGroupCommit_TimestampKeyKeepsReusedIDsApart(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	p := f.groupCommit(t, 2, processor.Func(insertEffect), withTimestamp())
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range 2 {
		wg.Go(func() {
			m := msg("reused")
			m.Timestamp = time.UnixMicro(int64(1_000_000 * (i + 1)))
			errs[i] = p.Process(context.Background(), m)
		})
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, 2, f.effects(t, "reused"))
	require.Equal(t, 2, f.recorded(t, "reused"))
}

func TestGroupTransaction_SharesOneCommitWithoutRecordingIDs(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		boom := errors.New("boom")
		mw, err := newGroupTransaction(f.cdb, maxSize(3), maxWait(time.Hour))
		require.NoError(t, err)
		p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			if err := insertEffect(ctx, m); err != nil {
				return err
			}
			if m.ID == "bad" {
				return boom
			}
			return nil
		}))

		out := processAll(p, "a", "bad", "a")
		require.NoError(t, out[0].err)
		require.ErrorIs(t, out[1].err, boom)
		require.NoError(t, out[2].err)
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Equal(t, 2, f.effects(t, "a"), "at least once: no duplicate detection")
		require.Equal(t, 0, f.effects(t, "bad"))
		require.Equal(t, 0, f.recorded(t, "a"))
	})
}

func TestNew_InvalidConfigIsAnErrorNamingTheField(t *testing.T) {
	positions := &dedup.Positions{}
	for name, tc := range map[string]struct {
		cfg  groupcommit.Config
		want string
	}{
		"no database":     {groupcommit.Config{}, "DB is nil"},
		"negative size":   {groupcommit.Config{DB: memtx.DB{}, MaxSize: -1}, "MaxSize: -1 is negative"},
		"negative wait":   {groupcommit.Config{DB: memtx.DB{}, MaxWait: -time.Second}, "MaxWait: -1s is negative"},
		"two detections":  {groupcommit.Config{DB: memtx.DB{}, Store: memGroupStore{}, Positions: positions}, "Store and Positions are both set"},
		"unknown policy":  {groupcommit.Config{DB: memtx.DB{}, BeyondRetention: 9}, "BeyondRetention: RetentionPolicy(9) is not a retention policy"},
		"negative groups": {groupcommit.Config{DB: memtx.DB{}, Concurrency: -1}, "Concurrency: -1 is negative"},
	} {
		t.Run(name, func(t *testing.T) {
			mw, err := groupcommit.New(tc.cfg)
			require.ErrorContains(t, err, tc.want)
			require.Nil(t, mw)
		})
	}
}

// memGroupStore records nothing and reports every key as new.
type memGroupStore struct{}

func (memGroupStore) RecordMany(_ context.Context, _ sqlx.ExtContext, keys []dedup.Key) ([]bool, error) {
	fresh := make([]bool, len(keys))
	for i := range fresh {
		fresh[i] = true
	}
	return fresh, nil
}

func (memGroupStore) Forget(context.Context, sqlx.ExtContext, dedup.Key) error { return nil }

func ExampleNew() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "groupcommit")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(dir, "app.db"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE payments (id TEXT PRIMARY KEY)`); err != nil {
		fmt.Println(err)
		return
	}
	store, _ := dedup.New(db, dedup.Config{})
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}

	// Deliveries in flight at once share a transaction; Retry stays outside, so every attempt
	// joins a group of its own.
	groupCommit, err := newGroupCommit(middleware.Pool(db), store, "payments", maxSize(4), maxWait(time.Second))
	if err != nil {
		fmt.Println(err)
		return
	}
	chain := middleware.Chain(middleware.Recover(), must(middleware.Retry{}.Middleware()), groupCommit)(
		processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, _ := processor.TxFromContext(ctx) // the group's transaction
			_, err := tx.ExecContext(ctx, `INSERT INTO payments (id) VALUES (?)`, msg.ID)
			return err
		}))

	var duplicates atomic.Int32
	var wg sync.WaitGroup
	for _, id := range []string{"p-1", "p-2", "p-3", "p-1"} { // p-1 is delivered twice
		wg.Go(func() {
			err := chain.Process(ctx, &messagedata.MessageData{ID: id})
			if processor.IsDuplicate(err) {
				duplicates.Add(1)
			} else if err != nil {
				fmt.Println(err)
			}
		})
	}
	wg.Wait()

	var payments int
	_ = db.Get(&payments, `SELECT COUNT(*) FROM payments`)
	fmt.Println("payments:", payments, "duplicates:", duplicates.Load())
	// Output: payments: 3 duplicates: 1
}

func TestGroupCommit_HappyPathSetsNoSavepoint(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		out := processAll(f.groupCommit(t, 6, processor.Func(insertEffect)), "a", "b", "c", "d", "e", "f")
		for _, o := range out {
			require.NoError(t, o.err)
		}
		require.Equal(t, int32(1), f.cdb.begins.Load())
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Zero(t, f.cdb.savepoints.Load(), "no round trip per member for a group that commits")
	})
}

// effectThenFail is a processor that writes each message's effect and then returns fail(id),
// and a function that returns how many times it ran for each id.
func effectThenFail(fail func(id string) error) (processor.Processor, func() map[string]int) {
	var mu sync.Mutex
	runs := map[string]int{}
	p := processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		mu.Lock()
		runs[m.ID]++
		mu.Unlock()
		if err := insertEffect(ctx, m); err != nil {
			return err
		}
		return fail(m.ID)
	})
	return p, func() map[string]int {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(runs)
	}
}

// requireApplied asserts how many effects and recorded ids each message has.
func (f *groupFixture) requireApplied(t *testing.T, want map[string]int) {
	t.Helper()
	for id, n := range want {
		require.Equal(t, n, f.effects(t, id), id)
		require.Equal(t, n, f.recorded(t, id), id)
	}
}

func TestGroupCommit_AfterAFailureTheRestRunOnceMoreUnderSavepoints(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		boom := errors.New("boom")
		proc, runs := effectThenFail(func(id string) error {
			if strings.HasPrefix(id, "bad") {
				return boom
			}
			return nil
		})
		p, ordered := f.orderedGroup(t, 4, proc)
		out := ordered(p, "ok-1", "bad-1", "ok-2", "bad-2")
		require.NoError(t, out[0].err)
		require.ErrorIs(t, out[1].err, boom)
		require.NoError(t, out[2].err)
		require.ErrorIs(t, out[3].err, boom)
		require.Equal(t, int32(2), f.cdb.begins.Load(), "the optimistic run, then one with savepoints")
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Equal(t, int32(3), f.cdb.savepoints.Load(), "one per member of the second run")
		require.Equal(t, map[string]int{"ok-1": 2, "bad-1": 1, "ok-2": 1, "bad-2": 1}, runs())
		f.requireApplied(t, map[string]int{"ok-1": 1, "ok-2": 1, "bad-1": 0, "bad-2": 0})
	})
}

// Under savepoints, a member that loses a conflict with another transaction (here a
// deadlock) must not leave the members before it holding their locks, which that transaction
// may be waiting for: the transaction is rolled back, and the others run again in a new one.
func TestGroupCommit_MemberLosingAConflictUnderSavepointsRollsBackTheWholeTransaction(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		boom := errors.New("boom")
		deadlock := fmt.Errorf("debit: %w", &pgconn.PgError{Code: "40P01", Message: "deadlock detected"})
		proc, runs := effectThenFail(func(id string) error {
			return map[string]error{"bad": boom, "victim": deadlock}[id]
		})
		p, ordered := f.orderedGroup(t, 4, proc)
		out := ordered(p, "ok-1", "bad", "victim", "ok-2")
		require.NoError(t, out[0].err)
		require.ErrorIs(t, out[1].err, boom)
		require.ErrorIs(t, out[2].err, deadlock, "the member that lost has its own failure, to be retried")
		require.NotErrorIs(t, out[2].err, middleware.ErrGroupAborted)
		require.NoError(t, out[3].err)
		require.Equal(t, int32(3), f.cdb.begins.Load(), "the optimistic run, the one under savepoints, and one after the conflict")
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Equal(t, map[string]int{"ok-1": 3, "bad": 1, "victim": 1, "ok-2": 1}, runs())
		f.requireApplied(t, map[string]int{"ok-1": 1, "ok-2": 1, "bad": 0, "victim": 0})
	})
}

func TestGroupCommit_SeveralGroupsRunAtOnceUpToConcurrency(t *testing.T) {
	// Not on SQLite, whose second writer waits for the first.
	f := newGroupFixture(t, testsvc.Databases()[1])
	require.Equal(t, "postgres", testsvc.Databases()[1].Name)
	var running, most atomic.Int32
	release := make(chan struct{})
	p := f.groupCommit(t, 1, processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		n := running.Add(1)
		for {
			old := most.Load()
			if n <= old || most.CompareAndSwap(old, n) {
				break
			}
		}
		if n == 2 {
			close(release) // two transactions are open at the same time
		}
		<-release
		running.Add(-1)
		return nil
	}), withConcurrency(2))
	for _, o := range processAll(p, "a", "b", "c", "d") {
		require.NoError(t, o.err)
	}
	require.Equal(t, int32(2), most.Load())
	require.Equal(t, int32(4), f.cdb.commits.Load())
}

func TestGroupCommit_MessagesArrivingWhileEveryTransactionIsBusyFormOneGroup(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	inFirst := make(chan struct{})
	joined := make(chan int, 16)
	release := make(chan struct{})
	var mu sync.Mutex
	sizes := map[middleware.Tx]int{}
	mw, err := newGroupCommit(f.cdb, f.store, "h", onJoin(func(n int) { joined <- n }))
	require.NoError(t, err)
	p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		tx, _ := middleware.CurrentTx(ctx)
		mu.Lock()
		sizes[tx]++
		mu.Unlock()
		if m.ID == "first" {
			close(inFirst)
			<-release
		}
		return insertEffect(ctx, m)
	}))
	first := make(chan error, 1)
	go func() { first <- p.Process(context.Background(), msg("first")) }()
	<-inFirst
	<-joined
	rest := make(chan []outcome, 1)
	go func() { rest <- processAll(p, "a", "b", "c", "d", "e") }()
	for range 5 {
		<-joined
	}
	close(release)
	require.NoError(t, <-first)
	for _, o := range <-rest {
		require.NoError(t, o.err)
	}
	var got []int
	for _, n := range sizes {
		got = append(got, n)
	}
	require.ElementsMatch(t, []int{1, 5}, got, "the five that came during the first commit share the next")
}

func batchGroup(t *testing.T, f *groupFixture, n int, b processor.Batch) processor.Processor {
	t.Helper()
	mw, err := newGroupCommit(f.cdb, f.store, "h", maxSize(n), maxWait(time.Hour), batch(b))
	require.NoError(t, err)
	return mw(processor.Func(func(context.Context, *messagedata.MessageData) error {
		return errors.New("the per-message processor of a batch chain ran")
	}))
}

// insertAll writes the effects of msgs with one multi-row INSERT.
func insertAll(ctx context.Context, msgs []*messagedata.MessageData) error {
	tx, _ := middleware.CurrentTx(ctx)
	var q strings.Builder
	args := make([]any, len(msgs))
	q.WriteString(`INSERT INTO gc_effects (id) VALUES `)
	for i, m := range msgs {
		if i > 0 {
			q.WriteString(",")
		}
		q.WriteString("(?)")
		args[i] = m.ID
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(q.String()), args...)
	return err
}

func TestGroupCommit_BatchGetsTheNewMessagesOfTheGroupInOneCall(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		require.NoError(t, batchGroup(t, f, 1, processor.BatchFunc(insertAll)).Process(context.Background(), msg("seen")))
		var calls [][]string
		var mu sync.Mutex
		p := batchGroup(t, f, 5, processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			var ids []string
			for _, m := range msgs {
				ids = append(ids, m.ID)
			}
			mu.Lock()
			calls = append(calls, ids)
			mu.Unlock()
			return insertAll(ctx, msgs)
		}))
		out := processAll(p, "a", "b", "seen", "c", "d")
		for i, o := range out {
			if i == 2 {
				require.ErrorIs(t, o.err, processor.ErrDuplicate)
				continue
			}
			require.NoError(t, o.err)
		}
		require.Len(t, calls, 1)
		require.ElementsMatch(t, []string{"a", "b", "c", "d"}, calls[0], "the duplicate is left out")
		require.Equal(t, int32(2), f.cdb.commits.Load())
		for _, id := range []string{"a", "b", "c", "d", "seen"} {
			require.Equal(t, 1, f.effects(t, id), id)
		}
	})
}

func TestGroupCommit_GroupContextEndsOnceEveryMembersContextHasEnded(t *testing.T) {
	for _, firstEnds := range []bool{true, false} {
		t.Run(fmt.Sprintf("first member's context ends first=%v", firstEnds), func(t *testing.T) {
			f := newGroupFixture(t, testsvc.Databases()[0])
			joined := make(chan int, 2)
			running := make(chan context.Context, 1)
			mw, err := newGroupCommit(f.cdb, f.store, "h", maxSize(2), maxWait(time.Hour),
				onJoin(func(size int) { joined <- size }),
				batch(processor.BatchFunc(func(ctx context.Context, _ []*messagedata.MessageData) error {
					running <- ctx
					select {
					case <-ctx.Done():
						return ctx.Err()
					case <-time.After(10 * time.Second):
						return errors.New("the group's context did not end")
					}
				})))
			require.NoError(t, err)
			p := mw(processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }))

			var ctxs [2]context.Context
			var cancels [2]context.CancelFunc
			errs := make(chan error, 2)
			for i, id := range []string{"first", "second"} {
				ctxs[i], cancels[i] = context.WithCancel(context.Background())
				go func() { errs <- p.Process(ctxs[i], msg(id)) }()
				require.Equal(t, i+1, <-joined)
			}
			group := <-running

			order := []int{0, 1}
			if !firstEnds {
				order = []int{1, 0}
			}
			cancels[order[0]]()
			select {
			case <-group.Done():
				t.Fatal("the group's context ended with one member's")
			case <-time.After(50 * time.Millisecond):
			}
			cancels[order[1]]()
			select {
			case <-group.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the group's context did not end with the last member's")
			}
			require.EqualError(t, context.Cause(group), "the context of every member has ended")
			for range 2 {
				require.ErrorIs(t, <-errs, middleware.ErrGroupAborted)
			}
			require.Equal(t, 0, f.effects(t, "first")+f.effects(t, "second"))
			require.Equal(t, int32(0), f.cdb.commits.Load())
		})
	}
}

func TestGroupCommit_BatchThatNamesAFailingMessageRunsAgainWithoutIt(t *testing.T) {
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		var calls atomic.Int32
		p := batchGroup(t, f, 4, processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			calls.Add(1)
			for _, m := range msgs {
				if m.ID == "bad" {
					return processor.ErrorFor(m, processor.Permanent(errors.New("amount is negative")))
				}
			}
			return insertAll(ctx, msgs)
		}))
		out := processAll(p, "a", "bad", "b", "c")
		require.True(t, processor.IsPermanent(out[1].err))
		require.ErrorContains(t, out[1].err, "amount is negative")
		for _, i := range []int{0, 2, 3} {
			require.NoError(t, out[i].err)
		}
		require.Equal(t, int32(2), calls.Load())
		require.Equal(t, int32(1), f.cdb.commits.Load())
		require.Equal(t, 0, f.effects(t, "bad"))
		require.Equal(t, 0, f.recorded(t, "bad"))
		require.Equal(t, 1, f.effects(t, "c"))
	})
}

func TestGroupCommit_BatchFailureNamingNobodyIsSplitUntilTheBadMessageIsAlone(t *testing.T) {
	// A multi-row INSERT that one value too long makes fail: the database does not say which.
	forEachDB(t, func(t *testing.T, d testsvc.Database) {
		f := newGroupFixture(t, d)
		_, err := f.db.Exec(`CREATE TABLE gc_short (id VARCHAR(8) NOT NULL)`)
		require.NoError(t, err)
		var calls atomic.Int32
		p := batchGroup(t, f, 8, processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			calls.Add(1)
			tx, _ := middleware.CurrentTx(ctx)
			for _, m := range msgs {
				if len(m.ID) > 8 && d.Name == "sqlite" { // SQLite does not enforce the length
					return errors.New("value too long for type character varying(8)")
				}
				if _, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO gc_short (id) VALUES (?)`), m.ID); err != nil {
					return err
				}
			}
			return insertAll(ctx, msgs)
		}))
		ids := []string{"m1", "m2", "m3", "m4", "too-long-id", "m6", "m7", "m8"}
		out := processAll(p, ids...)
		for i, o := range out {
			if ids[i] == "too-long-id" {
				require.Error(t, o.err)
				require.Equal(t, processor.Failed, processor.OutcomeOf(o.err))
				require.Equal(t, 0, f.effects(t, ids[i]))
				continue
			}
			require.NoError(t, o.err, ids[i])
			require.Equal(t, 1, f.effects(t, ids[i]), ids[i])
			require.Equal(t, 1, f.recorded(t, ids[i]), ids[i])
		}
		// 8 fail; 4 fail, 4 commit; 2 fail, 2 commit; 1 fails, 1 commits.
		require.Equal(t, int32(7), calls.Load())
		require.Equal(t, int32(3), f.cdb.commits.Load())
	})
}

func TestGroupCommit_BatchFailingForTheDatabasesSakeFailsEveryMemberRetryably(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	conflict := &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
	var calls atomic.Int32
	p := batchGroup(t, f, 3, processor.BatchFunc(func(context.Context, []*messagedata.MessageData) error {
		calls.Add(1)
		return conflict
	}))
	for _, o := range processAll(p, "a", "b", "c") {
		require.ErrorIs(t, o.err, conflict)
		require.Equal(t, processor.Failed, processor.OutcomeOf(o.err))
	}
	require.Equal(t, int32(1), calls.Load(), "no split: no message is to blame")
}

func TestGroupCommit_BatchPanicIsFoundAndRaisedInItsMembersGoroutine(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	p := middleware.Recover()(batchGroup(t, f, 4, processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
		for _, m := range msgs {
			if m.ID == "bug" {
				panic("index out of range")
			}
		}
		return insertAll(ctx, msgs)
	})))
	out := processAll(p, "a", "bug", "b", "c")
	require.Equal(t, processor.Panicked, processor.OutcomeOf(out[1].err))
	for _, i := range []int{0, 2, 3} {
		require.NoError(t, out[i].err)
	}
	require.Equal(t, 0, f.effects(t, "bug"))
	require.Equal(t, 1, f.effects(t, "c"))
}

func TestGroupCommit_JSONBatchDeadLettersWhatDoesNotDecodeAndAppliesTheRest(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	type payment struct{ Cents int }
	var seen []int
	p := batchGroup(t, f, 3, processor.JSONBatch(func(ctx context.Context, msgs []*messagedata.MessageData, vs []payment) error {
		for _, v := range vs {
			seen = append(seen, v.Cents)
		}
		return insertAll(ctx, msgs)
	}))
	ids := []string{"p1", "p2", "p3"}
	payloads := map[string]string{"p1": `{"Cents": 1}`, "p2": `{"Cents": `, "p3": `{"Cents": 3}`}
	out := make([]outcome, 3)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() {
			m := msg(id)
			m.Payload = []byte(payloads[id])
			out[i].err = p.Process(context.Background(), m)
		})
	}
	wg.Wait()
	require.NoError(t, out[0].err)
	require.True(t, processor.IsPermanent(out[1].err), "%v", out[1].err)
	require.NoError(t, out[2].err)
	require.ElementsMatch(t, []int{1, 3}, seen)
	require.Equal(t, 0, f.effects(t, "p2"))
}

func TestGroupCommit_JoinedLaneRunsOneGroupAtATimeAndTheNextCollects(t *testing.T) {
	// Not on SQLite, whose second writer waits for the first.
	f := newGroupFixture(t, testsvc.Databases()[1])
	entered, release := make(chan string, 10), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // a failing test lets its groups end
	mw, err := newGroupCommit(f.cdb, f.store, "h", withConcurrency(3))
	require.NoError(t, err)
	p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		entered <- m.ID
		<-release
		return insertEffect(ctx, m)
	}))
	j, ok := p.(groupcommit.Joiner)
	require.True(t, ok, "GroupCommit's processor is a Joiner")
	results := make(chan error, 10)
	join := func(lane int, id string) {
		j.Join(context.Background(), msg(id), lane, nil, groupcommit.JoinedFunc(func(err error) { results <- err }))
	}

	join(1, "a1") // lane 1's first group starts at once, alone
	require.Equal(t, "a1", <-entered)
	join(1, "a2") // while it runs, lane 1's next group collects, though transactions are free
	join(1, "a3")
	join(2, "b1") // another lane starts a group of its own at once
	require.Equal(t, "b1", <-entered)
	select {
	case id := <-entered:
		t.Fatalf("%s ran while its lane's group was running", id)
	case <-time.After(100 * time.Millisecond):
	}
	free()
	for range 4 {
		require.NoError(t, <-results)
	}
	require.Equal(t, "a2", <-entered) // one group of the two that collected
	require.Equal(t, "a3", <-entered)
	require.Equal(t, int32(3), f.cdb.commits.Load(), "a1, b1, then a2 and a3 together")
	for _, id := range []string{"a1", "a2", "a3", "b1"} {
		require.Equal(t, 1, f.effects(t, id), id)
	}
}

// The last member of a group that its consumer settles at once (committed, or a duplicate)
// ends the group: its consumer sends the group's acknowledgements together after its own.
func TestGroupCommit_JoinedGroupMarksItsLastSettledMember(t *testing.T) {
	f := newGroupFixture(t, testsvc.Databases()[0])
	entered, release := make(chan string, 10), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	mw, err := newGroupCommit(f.cdb, f.store, "h")
	require.NoError(t, err)
	p := mw(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		entered <- m.ID
		<-release
		if m.ID == "a4" {
			return errors.New("a4 fails")
		}
		return insertEffect(ctx, m)
	}))
	j := p.(groupcommit.Joiner)
	type result struct {
		id  string
		err error
		st  *delivery.State
	}
	results := make(chan result, 10)
	join := func(id string) {
		ctx, st := delivery.Start(context.Background(), "h", time.Now())
		j.Join(ctx, msg(id), 1, &groupcommit.Slot{}, groupcommit.JoinedFunc(func(err error) { results <- result{id, err, st} }))
	}

	join("a1") // a group of its own, held
	require.Equal(t, "a1", <-entered)
	for _, id := range []string{"a2", "a3", "a4"} {
		join(id) // the next group: a4, its last member, fails
	}
	free()
	ends := map[string]bool{}
	for range 4 {
		r := <-results
		require.Equal(t, r.id == "a4", r.err != nil, "%s: %v", r.id, r.err)
		ends[r.id] = r.st.EndsGroup
	}
	require.Equal(t, map[string]bool{"a1": true, "a2": false, "a3": true, "a4": false}, ends)
}

// option sets a field of a group transaction's Config.
type option func(*groupcommit.Config)

func maxSize(n int) option           { return func(c *groupcommit.Config) { c.MaxSize = n } }
func maxWait(d time.Duration) option { return func(c *groupcommit.Config) { c.MaxWait = d } }
func withConcurrency(n int) option   { return func(c *groupcommit.Config) { c.Concurrency = n } }
func batch(b processor.Batch) option { return func(c *groupcommit.Config) { c.Batch = b } }
func withTimestamp() option          { return func(c *groupcommit.Config) { c.WithTimestamp = true } }
func onJoin(fn func(size int)) option {
	return func(c *groupcommit.Config) { groupcommit.SetJoined(c, fn) }
}

// newGroupCommit returns the group transaction on db that records its members' ids for handler
// in store.
func newGroupCommit(db middleware.Beginner, store groupcommit.Store, handler string, opts ...option) (middleware.Middleware, error) {
	cfg := groupcommit.Config{DB: db, Store: store, Handler: handler}
	for _, o := range opts {
		o(&cfg)
	}
	return groupcommit.New(cfg)
}

// newGroupTransaction returns the group transaction on db that records nothing.
func newGroupTransaction(db middleware.Beginner, opts ...option) (middleware.Middleware, error) {
	cfg := groupcommit.Config{DB: db}
	for _, o := range opts {
		o(&cfg)
	}
	return groupcommit.New(cfg)
}

// must returns the middleware that its constructor made, and panics, failing the test, when
// the constructor refused its configuration.
func must(mw middleware.Middleware, err error) middleware.Middleware {
	if err != nil {
		panic(err)
	}
	return mw
}
