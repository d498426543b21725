package middleware_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

func newDB(t *testing.T) *sqldb.DB {
	t.Helper()
	db := testsvc.SQLite(t)
	_, err := db.Exec(`CREATE TABLE writes (id TEXT NOT NULL)`)
	require.NoError(t, err)
	return db
}

func countWrites(t *testing.T, db *sqldb.DB) int {
	t.Helper()
	var n int
	require.NoError(t, db.Get(&n, `SELECT COUNT(*) FROM writes`))
	return n
}

func write(ctx context.Context, msg *messagedata.MessageData) error {
	tx, ok := processor.TxFromContext(ctx)
	if !ok {
		return errors.New("no transaction")
	}
	_, err := tx.ExecContext(ctx, `INSERT INTO writes (id) VALUES (?)`, msg.ID)
	return err
}

func msg(id string) *messagedata.MessageData {
	return &messagedata.MessageData{ID: id, Topic: "t", Attempt: 1}
}

func TestTransaction_CommitsOnNil(t *testing.T) {
	db := newDB(t)
	p := middleware.Transaction{}.Middleware(middleware.Pool(db))(processor.Func(write))
	require.NoError(t, p.Process(context.Background(), msg("a")))
	require.Equal(t, 1, countWrites(t, db))
}

func TestTransaction_RollsBackOnError(t *testing.T) {
	db := newDB(t)
	boom := errors.New("boom")
	p := middleware.Transaction{}.Middleware(middleware.Pool(db))(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		require.NoError(t, write(ctx, m))
		return boom
	}))
	require.ErrorIs(t, p.Process(context.Background(), msg("a")), boom)
	require.Equal(t, 0, countWrites(t, db))
}

func TestTransaction_RollsBackOnPanicAndRepanics(t *testing.T) {
	db := newDB(t)
	p := middleware.Transaction{}.Middleware(middleware.Pool(db))(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		require.NoError(t, write(ctx, m))
		panic("bug")
	}))
	require.PanicsWithValue(t, "bug", func() { _ = p.Process(context.Background(), msg("a")) })
	require.Equal(t, 0, countWrites(t, db))
}

func TestTransaction_CommitFailureIsReturned(t *testing.T) {
	db := newDB(t)
	p := middleware.Transaction{}.Middleware(middleware.Pool(db))(processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		tx, _ := processor.TxFromContext(ctx)
		// Finish the transaction behind the middleware's back: its commit must fail, and the
		// failure must not read as success.
		return tx.Rollback()
	}))
	err := p.Process(context.Background(), msg("a"))
	require.ErrorContains(t, err, "commit")
	require.NotErrorIs(t, err, middleware.ErrCommitOutcomeUnknown)
}

func TestRecover_TurnsPanicIntoPanicError(t *testing.T) {
	p := middleware.Recover()(processor.Func(func(context.Context, *messagedata.MessageData) error { panic("bug") }))
	err := p.Process(context.Background(), msg("a"))
	var pe *processor.PanicError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "bug", pe.Value)
	require.NotEmpty(t, pe.Stack)
	require.Equal(t, processor.Panicked, processor.OutcomeOf(err))
}

func TestRetry_ReRunsEverythingInsideWithAFreshTransaction(t *testing.T) {
	db := newDB(t)
	var attempts []int
	p := middleware.Chain(must(middleware.Retry{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond}.Middleware()), middleware.Transaction{}.Middleware(middleware.Pool(db)))(
		processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			attempts = append(attempts, m.Attempt)
			require.NoError(t, write(ctx, m))
			if m.Attempt < 3 {
				return errors.New("transient")
			}
			return nil
		}))
	require.NoError(t, p.Process(context.Background(), msg("a")))
	require.Equal(t, []int{1, 2, 3}, attempts)
	require.Equal(t, 1, countWrites(t, db), "the failed attempts' writes were rolled back")
}

func TestRetry_GivesUpAfterMaxAttempts(t *testing.T) {
	var calls atomic.Int32
	transient := errors.New("transient")
	p := must(middleware.Retry{MaxAttempts: 4, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond}.Middleware())(
		processor.Func(func(context.Context, *messagedata.MessageData) error { calls.Add(1); return transient }))
	require.ErrorIs(t, p.Process(context.Background(), msg("a")), transient)
	require.Equal(t, int32(4), calls.Load())
}

func TestRetry_DoesNotRetryPermanentDuplicateOrDeadLettered(t *testing.T) {
	for name, e := range map[string]error{
		"permanent":     processor.Permanent(errors.New("bad")),
		"duplicate":     processor.AlreadyProcessed("seen"),
		"dead-lettered": processor.ErrDeadLettered,
	} {
		t.Run(name, func(t *testing.T) {
			var calls atomic.Int32
			p := must(middleware.Retry{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond}.Middleware())(
				processor.Func(func(context.Context, *messagedata.MessageData) error { calls.Add(1); return e }))
			require.ErrorIs(t, p.Process(context.Background(), msg("a")), e)
			require.Equal(t, int32(1), calls.Load())
		})
	}
}

func TestRetry_StopsWhenContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int32
	p := must(middleware.Retry{MaxAttempts: 100, InitialInterval: time.Hour, MaxInterval: time.Hour}.Middleware())(
		processor.Func(func(context.Context, *messagedata.MessageData) error {
			if calls.Add(1) == 1 {
				cancel()
			}
			return errors.New("transient")
		}))
	err := p.Process(ctx, msg("a"))
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, int32(1), calls.Load())
}

func TestTimeout_CancelsTheAttempt(t *testing.T) {
	p := middleware.Timeout(10 * time.Millisecond)(processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
		<-ctx.Done()
		return ctx.Err()
	}))
	require.ErrorIs(t, p.Process(context.Background(), msg("a")), context.DeadlineExceeded)
}

func TestDeduplicate_SecondDeliveryIsDuplicate(t *testing.T) {
	db := newDB(t)
	store, err := dedup.New(db, dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	p := middleware.Chain(middleware.Transaction{}.Middleware(middleware.Pool(db)), must(middleware.Dedup{Store: store}.Middleware(nil, "h")))(processor.Func(write))

	require.NoError(t, p.Process(context.Background(), msg("a")))
	err = p.Process(context.Background(), msg("a"))
	require.ErrorIs(t, err, processor.ErrDuplicate)
	require.Equal(t, processor.Duplicate, processor.OutcomeOf(err))
	require.Equal(t, 1, countWrites(t, db))
}

func TestDeduplicate_RefusesMessageWithoutID(t *testing.T) {
	db := newDB(t)
	store, err := dedup.New(db, dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	p := middleware.Chain(middleware.Transaction{}.Middleware(middleware.Pool(db)), must(middleware.Dedup{Store: store}.Middleware(nil, "h")))(processor.Func(write))

	err = p.Process(context.Background(), msg(""))
	require.ErrorIs(t, err, messagedata.ErrNoMessageID)
	require.True(t, processor.IsPermanent(err))
	require.Equal(t, 0, countWrites(t, db))
}

func TestDeduplicate_OutsideTransactionIsAnError(t *testing.T) {
	db := newDB(t)
	store, err := dedup.New(db, dedup.Config{})
	require.NoError(t, err)
	p := must(middleware.Dedup{Store: store}.Middleware(nil, "h"))(processor.Func(write))
	require.ErrorIs(t, p.Process(context.Background(), msg("a")), middleware.ErrNoTransaction)
}

func TestDeduplicate_CheckFirstMintsTimeOrderedInternalIDs(t *testing.T) {
	db := newDB(t)
	store, err := dedup.New(db, dedup.Config{Retention: 24 * time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	var internal []string
	p := middleware.Chain(middleware.Transaction{}.Middleware(middleware.Pool(db)), must(middleware.Dedup{Mode: middleware.DedupCheckFirst, Store: store}.Middleware(nil, "h")))(
		processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
			id, ok := processor.InternalID(ctx)
			require.True(t, ok)
			internal = append(internal, id)
			return write(ctx, m)
		}))

	require.NoError(t, p.Process(context.Background(), msg("ext-1")))
	require.NoError(t, p.Process(context.Background(), msg("ext-2")))
	err = p.Process(context.Background(), msg("ext-1"))
	require.ErrorIs(t, err, processor.ErrDuplicate)
	require.ErrorContains(t, err, internal[0], "the duplicate names the internal id it maps to")
	require.Len(t, internal, 2)
	require.Less(t, internal[0], internal[1], "internal ids are time-ordered")
	require.Equal(t, 2, countWrites(t, db))
}

// pkName is what each database calls the primary key of the payments table of these tests,
// and uniqueName the unique constraint of the refs table.
var pkName = map[string]string{"postgres": "payments_pkey", "mysql": "PRIMARY", "sqlite": "payments.id"}
var uniqueName = map[string]string{"postgres": "uq_ref", "mysql": "uq_ref", "sqlite": "refs.ref"}

func TestNaturalIdempotency_OnlyTheNamedConstraintMeansAlreadyProcessed(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			for _, ddl := range []string{
				`CREATE TABLE payments (id VARCHAR(64) PRIMARY KEY)`,
				`CREATE TABLE refs (ref VARCHAR(64) NOT NULL, CONSTRAINT uq_ref UNIQUE (ref))`,
			} {
				_, err := db.Exec(ddl)
				require.NoError(t, err)
			}
			insert := processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
				tx, _ := processor.TxFromContext(ctx)
				if _, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO payments (id) VALUES (?)`), m.ID); err != nil {
					return err
				}
				_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO refs (ref) VALUES (?)`), string(m.Payload))
				return err
			})
			p := middleware.Chain(middleware.Transaction{}.Middleware(middleware.Pool(db)), must(middleware.Dedup{Mode: middleware.DedupNatural, UniqueConstraints: []string{pkName[d.Name]}}.Middleware(nil, "h")))(insert)
			payment := func(id, ref string) *messagedata.MessageData {
				m := msg(id)
				m.Payload = []byte(ref)
				return m
			}

			require.NoError(t, p.Process(context.Background(), payment("pay-1", "ref-1")))
			err := p.Process(context.Background(), payment("pay-1", "ref-1"))
			require.ErrorIs(t, err, processor.ErrDuplicate, "the same payment again")

			// Another payment with a reference that is taken: a conflict, not a duplicate.
			err = p.Process(context.Background(), payment("pay-2", "ref-1"))
			require.NotErrorIs(t, err, processor.ErrDuplicate)
			name, ok := sqldb.UniqueConstraint(err)
			require.True(t, ok, "%v", err)
			require.Equal(t, uniqueName[d.Name], name)
			require.True(t, middleware.DefaultClassifier(err), "dead-lettered, not dropped")
			var n int
			require.NoError(t, db.Get(&n, `SELECT COUNT(*) FROM payments`))
			require.Equal(t, 1, n)
		})
	}
}

func TestCheckVersion(t *testing.T) {
	require.ErrorIs(t, processor.CheckVersion(3, 3), processor.ErrDuplicate)
	require.ErrorIs(t, processor.CheckVersion(5, 3), processor.ErrDuplicate)
	err := processor.CheckVersion(1, 3)
	require.ErrorIs(t, err, processor.ErrPredecessorMissing)
	require.False(t, middleware.DefaultClassifier(err), "retried and redelivered")
	require.ErrorIs(t, processor.CheckVersion(2, 3), processor.ErrPredecessorMissing, "its predecessor committed just now: run it again")
}

type failingPublisher struct{ err error }

func (p failingPublisher) Publish(string, ...*message.Message) error { return p.err }
func (failingPublisher) Close() error                                { return nil }

func TestDeadLetter_PublishesPermanentFailuresWithReason(t *testing.T) {
	b := brokertest.New()
	p := must(middleware.DeadLetter{}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error {
		return processor.Permanent(errors.New("amount is negative"))
	}))
	m := msg("a")
	m.Payload = []byte("payload")
	m.Headers = map[string]string{"x-trace": "1"}
	err := p.Process(context.Background(), m)
	require.ErrorIs(t, err, processor.ErrDeadLettered)
	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(err))

	dead := b.Drain("dead")
	require.Len(t, dead, 1)
	require.Equal(t, "a", dead[0].UUID)
	require.Equal(t, "payload", string(dead[0].Payload))
	require.Equal(t, "1", dead[0].Metadata.Get("x-trace"))
	require.Equal(t, "permanent: amount is negative", dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason))
	require.Equal(t, "h", dead[0].Metadata.Get(messagedata.HeaderDeadLetterHandler))
	require.Equal(t, "1", dead[0].Metadata.Get(messagedata.HeaderDeadLetterAttempt))
	require.Equal(t, "t", dead[0].Metadata.Get(messagedata.HeaderDeadLetterTopic))
}

func TestDeadLetter_PublishFailureIsNotAnAck(t *testing.T) {
	p := must(middleware.DeadLetter{}.Middleware(failingPublisher{errors.New("broker down")}, "dead", "h"))(
		processor.Func(func(context.Context, *messagedata.MessageData) error {
			return processor.Permanent(errors.New("bad"))
		}))
	err := p.Process(context.Background(), msg("a"))
	require.ErrorContains(t, err, "broker down")
	require.Equal(t, processor.Failed, processor.OutcomeOf(err), "the router nacks: the message is not lost")
}

func TestDeadLetter_PassesOtherOutcomesThrough(t *testing.T) {
	b := brokertest.New()
	transient := errors.New("transient")
	for _, e := range []error{nil, transient, processor.AlreadyProcessed("seen")} {
		p := must(middleware.DeadLetter{}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error { return e }))
		require.Equal(t, e, p.Process(context.Background(), msg("a")))
	}
	require.Empty(t, b.Drain("dead"))
}

// must returns the middleware that its constructor made, and panics, failing the test, when
// the constructor refused its options.
func must(mw middleware.Middleware, err error) middleware.Middleware {
	if err != nil {
		panic(err)
	}
	return mw
}

// An invalid field is an error of the constructor that names the field, not a value clamped
// in silence or a failure at the first message.
func TestMiddleware_InvalidConfigurationIsAnErrorNamingTheField(t *testing.T) {
	t.Parallel()
	pub := brokertest.New()
	for name, tc := range map[string]struct {
		build func() (middleware.Middleware, error)
		names string
	}{
		"negative attempts": {func() (middleware.Middleware, error) { return middleware.Retry{MaxAttempts: -1}.Middleware() },
			"Retry.MaxAttempts: -1 is negative"},
		"negative wait": {func() (middleware.Middleware, error) {
			return middleware.Retry{InitialInterval: -time.Second}.Middleware()
		}, "Retry.InitialInterval: -1s is negative"},
		"longest wait shorter than the first": {func() (middleware.Middleware, error) {
			return middleware.Retry{InitialInterval: time.Second, MaxInterval: time.Millisecond}.Middleware()
		}, "Retry.MaxInterval: 1ms is shorter than the first wait, 1s"},
		"no dead-letter publisher": {func() (middleware.Middleware, error) { return middleware.DeadLetter{}.Middleware(nil, "dead", "h") }, "publisher"},
		"no dead-letter topic":     {func() (middleware.Middleware, error) { return middleware.DeadLetter{}.Middleware(pub, "", "h") }, "topic"},
		"unknown retention policy": {func() (middleware.Middleware, error) {
			return middleware.Dedup{Store: memStore{}, BeyondRetention: dedup.RetentionPolicy(99)}.Middleware(nil, "h")
		}, "Dedup.BeyondRetention: RetentionPolicy(99) is not a retention policy"},
		"unknown mode": {func() (middleware.Middleware, error) { return middleware.Dedup{Mode: 42}.Middleware(nil, "h") },
			"Dedup.Mode: DedupMode(42) is not a dedup mode"},
		"no dedup store": {func() (middleware.Middleware, error) { return middleware.Dedup{}.Middleware(nil, "h") }, "the database and Store are nil"},
		"natural idempotency without constraints": {func() (middleware.Middleware, error) {
			return middleware.Dedup{Mode: middleware.DedupNatural}.Middleware(nil, "h")
		}, "Dedup.UniqueConstraints: empty"},
		"constraints without natural idempotency": {func() (middleware.Middleware, error) {
			return middleware.Dedup{Store: memStore{}, UniqueConstraints: []string{"pk"}}.Middleware(nil, "h")
		}, "Dedup.UniqueConstraints: set, but DedupInsertFirst does not read it"},
		"a table for a mode without one": {func() (middleware.Middleware, error) {
			return middleware.Dedup{Mode: middleware.DedupAckInTransaction, Table: "log"}.Middleware(nil, "h")
		}, "Dedup.Table: set, but DedupAckInTransaction keeps no dedup table"},
		"a table that is no identifier": {func() (middleware.Middleware, error) {
			return middleware.Dedup{Table: "x; DROP TABLE y"}.Middleware(nil, "h")
		}, "Dedup.Table: \"x; DROP TABLE y\" is not a plain SQL identifier"},
	} {
		t.Run(name, func(t *testing.T) {
			mw, err := tc.build()
			require.ErrorContains(t, err, tc.names)
			require.Nil(t, mw)
		})
	}
	for name, build := range map[string]func() (middleware.Middleware, error){
		"defaults":    func() (middleware.Middleware, error) { return middleware.Retry{}.Middleware() },
		"one attempt": func() (middleware.Middleware, error) { return middleware.Retry{MaxAttempts: 1}.Middleware() },
		"no limit": func() (middleware.Middleware, error) {
			return middleware.DeadLetter{MaxDeliveries: -1}.Middleware(pub, "dead", "h")
		},
		"default policy": func() (middleware.Middleware, error) { return middleware.Dedup{Store: memStore{}}.Middleware(nil, "h") },
	} {
		t.Run(name, func(t *testing.T) {
			mw, err := build()
			require.NoError(t, err)
			require.NotNil(t, mw)
		})
	}
}
