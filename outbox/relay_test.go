package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/outbox"
)

func TestRelay_RestartResumesWithoutLossOrResend(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		rec := newRecorder()
		first := e.commitN(t, "first", 5)
		r := start(t, relayConfig(e, open(t, e.url), rec))
		rec.waitFor(t, 5)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))

		second := e.commitN(t, "second", 3)
		r = start(t, relayConfig(e, open(t, e.url), rec))
		rec.waitFor(t, 8)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))
		require.Equal(t, append(first, second...), rec.ids())
	})
}

func TestRelay_CloseLetsTheMessageInFlightFinishAndCommitsIt(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ids := e.commitN(t, "order", 4)
		rec := newRecorder()
		r, err := outbox.NewRelay(relayConfig(e, e.db, rec))
		require.NoError(t, err)
		// The second message's publish ends only once Close has begun.
		rec.after = func(m *message.Message, _ int) error {
			if m.UUID == ids[1] {
				<-r.Stopping()
			}
			return nil
		}
		running := run(t, r)
		rec.waitFor(t, 2)
		require.NoError(t, running.stop(t))
		require.Equal(t, ids[:2], rec.ids())

		rec.after = nil
		r2 := start(t, relayConfig(e, e.db, rec))
		rec.waitFor(t, 4)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r2.stop(t))
		require.Equal(t, ids, rec.ids(), "the message in flight at Close was committed, not sent again")
	})
}

func TestRelay_CrashWhilePublishingSendsTheMessageAgain(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ids := e.commitN(t, "order", 5)
		rec := newRecorder()
		reached, release := make(chan struct{}), make(chan struct{})
		rec.after = func(m *message.Message, attempt int) error {
			if m.UUID == ids[2] && attempt == 0 {
				close(reached)
				<-release
			}
			return nil
		}
		cfg := relayConfig(e, open(t, e.url), rec)
		cfg.BatchSize = 10
		r := start(t, cfg)
		<-reached
		r.Kill() // the relay dies while the destination takes the third message
		close(release)
		r.waitStopped(t)
		require.Equal(t, ids[:3], rec.ids())

		r2 := start(t, relayConfig(e, open(t, e.url), rec))
		rec.waitFor(t, 6)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r2.stop(t))
		require.Equal(t, append(ids[:3:3], ids[2:]...), rec.ids(),
			"at least once: the message whose publish the relay did not see end is sent again, the ones acknowledged before are not")
	})
}

// orderedResend is the wait before a failed message is sent again in the tests that check it
// comes after the one behind it: long enough that the one behind goes first on a loaded
// machine, where the relay config's 10 ms is not.
const orderedResend = 300 * time.Millisecond

func TestRelay_FailedPublishIsSentAgainLaterWhileTheOthersGoOn(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ids := e.commitN(t, "order", 3)
		rec := newRecorder()
		rec.before = func(m *message.Message, attempt int) error {
			if m.UUID == ids[1] && attempt < 2 {
				return fmt.Errorf("broker unavailable (attempt %d)", attempt+1)
			}
			return nil
		}
		dlq := newRecorder()
		cfg := relayConfig(e, e.db, rec)
		cfg.DeadLetterPublisher = dlq
		cfg.ResendInterval, cfg.MaxResendInterval = orderedResend, orderedResend
		r := start(t, cfg)
		rec.waitFor(t, 3)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))
		require.Equal(t, []string{ids[0], ids[2], ids[1]}, rec.ids(), "nothing lost; the failing message does not hold back the one behind it")
		require.Empty(t, dlq.ids())
		rec.mu.Lock()
		defer rec.mu.Unlock()
		require.Equal(t, map[string]int{ids[0]: 1, ids[1]: 3, ids[2]: 1}, rec.attempts)
	})
}

func TestRelay_LostConfirmationSendsTheSameIDAgainAndDedupAbsorbsIt(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ids := e.commitN(t, "order", 3)
		rec := newRecorder()
		rec.after = func(m *message.Message, attempt int) error {
			if m.UUID == ids[1] && attempt == 0 {
				return errors.New("connection lost before the broker's confirmation")
			}
			return nil
		}
		cfg := relayConfig(e, e.db, rec)
		cfg.ResendInterval, cfg.MaxResendInterval = orderedResend, orderedResend
		r := start(t, cfg)
		rec.waitFor(t, 4)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))
		require.Equal(t, []string{ids[0], ids[1], ids[2], ids[1]}, rec.ids(), "the message whose confirmation was lost is sent again, after the one behind it")

		// The consumer downstream records each message id in its transaction: the copy is a
		// duplicate, and each message is processed exactly once.
		ctx := context.Background()
		downstream := testsvc.SQLite(t)
		store, err := dedup.New(downstream, dedup.Config{})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx))
		var processed []string
		for _, s := range rec.all() {
			tx, err := downstream.BeginTxx(ctx, nil)
			require.NoError(t, err)
			fresh, err := store.Record(ctx, tx, dedup.Key{Handler: "shipping", MessageID: s.msg.UUID}, "")
			require.NoError(t, err)
			require.NoError(t, tx.Commit())
			if fresh {
				processed = append(processed, s.msg.UUID)
			}
		}
		require.Equal(t, ids, processed)
	})
}

// Two relays of one group, on two connection pools as on two nodes, share the work: they claim
// different messages, and the consumers downstream, deduplicating by message id, apply each
// message exactly once. In normal operation no message is even sent twice.
func TestRelay_TwoRelaysOfOneGroupShareTheWorkAndDeliverEachMessageOnce(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		// Small windows and a destination that takes a millisecond per message, so that
		// neither relay can claim everything before the other looks.
		slow := func(*message.Message, int) error { time.Sleep(time.Millisecond); return nil }
		recA, recB := newRecorder(), newRecorder()
		recA.before, recB.before = slow, slow
		cfgA, cfgB := relayConfig(e, open(t, e.url), recA), relayConfig(e, open(t, e.url), recB)
		cfgA.BatchSize, cfgB.BatchSize = 5, 5
		a, b := start(t, cfgA), start(t, cfgB)

		// Twenty messages before, and four producers publishing 20 each while both run.
		want := e.commitN(t, "before", 20)
		const producers, perProducer = 4, 20
		ids := make([][]string, producers)
		var wg sync.WaitGroup
		errs := make([]error, producers)
		for p := range producers {
			wg.Go(func() {
				for i := range perProducer {
					in := fmt.Sprintf("p%d-%02d", p, i)
					id := outbox.DerivedID(in, "shipped")
					if err := e.process(context.Background(), in, nil, message.NewMessage(id, []byte(in))); err != nil {
						errs[p] = err
						return
					}
					ids[p] = append(ids[p], id)
				}
			})
		}
		wg.Wait()
		require.NoError(t, errors.Join(errs...))
		for _, p := range ids {
			want = append(want, p...)
		}

		testsvc.Eventually(t, waitTimeout, func() bool { return len(recA.ids())+len(recB.ids()) >= len(want) },
			"the relays did not send the %d messages", len(want))
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, a.stop(t))
		require.NoError(t, b.stop(t))

		sentA, sentB := recA.ids(), recB.ids()
		t.Logf("relay A sent %d messages, relay B %d", len(sentA), len(sentB))
		require.NotEmpty(t, sentA, "relay A sent nothing: the relays do not share the work")
		require.NotEmpty(t, sentB, "relay B sent nothing: the relays do not share the work")
		require.ElementsMatch(t, want, append(sentA, sentB...), "each message sent once, by one of the relays")

		// Downstream, deduplication by message id applies each message exactly once.
		ctx := context.Background()
		downstream := testsvc.SQLite(t)
		store, err := dedup.New(downstream, dedup.Config{})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx))
		applied := map[string]int{}
		for _, id := range append(sentA, sentB...) {
			tx, err := downstream.BeginTxx(ctx, nil)
			require.NoError(t, err)
			fresh, err := store.Record(ctx, tx, dedup.Key{Handler: "shipping", MessageID: id}, "")
			require.NoError(t, err)
			require.NoError(t, tx.Commit())
			if fresh {
				applied[id]++
			}
		}
		require.Len(t, applied, len(want))
		for id, n := range applied {
			require.Equal(t, 1, n, id)
		}
	})
}

func TestRelay_TransactionCommittingLateIsNotOvertaken(t *testing.T) {
	t.Parallel()
	// SQLite has one writer at a time: a later transaction cannot commit before an earlier one.
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		e := setup(t, testsvc.Databases()[1], outbox.Config{})
		ctx := context.Background()
		rec := newRecorder()
		r := start(t, relayConfig(e, open(t, e.url), rec))

		slow, err := e.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer slow.Rollback()
		require.NoError(t, e.ob.PublishTx(ctx, slow, topic, message.NewMessage("early", []byte("written first, committed last"))))
		fast, err := e.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, e.ob.PublishTx(ctx, fast, topic, message.NewMessage("late", []byte("written second, committed first"))))
		require.NoError(t, fast.Commit())

		// The relay, woken by the fast commit and polling every 10 ms, looks at the outbox while
		// the slow transaction is open, and must not send the late message: its cursor would
		// then pass the early one's.
		time.Sleep(300 * time.Millisecond)
		require.Empty(t, rec.ids())

		require.NoError(t, slow.Commit())
		rec.waitFor(t, 2)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))
		require.Equal(t, []string{"early", "late"}, rec.ids())
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		e := setup(t, testsvc.Databases()[2], outbox.Config{Table: testsvc.UniqueName("late")})
		ctx := context.Background()
		rec := newRecorder()
		r := start(t, relayConfig(e, open(t, e.url), rec))

		slow, err := e.db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer slow.Rollback()
		require.NoError(t, e.ob.PublishTx(ctx, slow, topic, message.NewMessage("early", []byte("written first, committed last"))))

		// The second publishing transaction waits for the first to end: offsets commit in the
		// order they were allocated.
		fastDone := make(chan error, 1)
		go func() {
			fast, err := e.db.BeginTx(ctx, nil)
			if err == nil {
				err = e.ob.PublishTx(ctx, fast, topic, message.NewMessage("late", []byte("written second")))
				if err == nil {
					err = fast.Commit()
				} else {
					_ = fast.Rollback()
				}
			}
			fastDone <- err
		}()
		testsvc.Eventually(t, waitTimeout, func() bool {
			// It is running its lock statement, which cannot finish while the first holds the lock.
			var n int
			require.NoError(t, e.db.QueryRow(`SELECT COUNT(*) FROM information_schema.PROCESSLIST
WHERE db = DATABASE() AND info LIKE ?`, "SELECT id FROM `"+e.ob.Table()+"_lock`%").Scan(&n))
			return n > 0
		}, "the second publishing transaction does not wait for the first")
		require.Empty(t, rec.ids())

		require.NoError(t, slow.Commit())
		require.NoError(t, <-fastDone)
		rec.waitFor(t, 2)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))
		require.Equal(t, []string{"early", "late"}, rec.ids())
	})
}

func TestRelay_RegisterMetricsReportsBacklogAndLag(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		e.commitN(t, "order", 2)
		r, err := outbox.NewRelay(relayConfig(e, e.db, newRecorder()))
		require.NoError(t, err)
		reader := sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		reg, err := r.RegisterMetrics(mp.Meter("test"))
		require.NoError(t, err)
		defer reg.Unregister()

		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(context.Background(), &rm))
		want := attribute.NewSet(outbox.AttrOutbox.String(outbox.DefaultTable), outbox.AttrConsumerGroup.String(outbox.DefaultConsumerGroup))
		found := map[string]bool{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				switch m.Name {
				case "onceflow.outbox.backlog":
					dp := m.Data.(metricdata.Gauge[int64]).DataPoints
					require.Len(t, dp, 1)
					require.Equal(t, int64(2), dp[0].Value)
					require.Equal(t, want, dp[0].Attributes)
					require.Equal(t, "{message}", m.Unit)
				case "onceflow.outbox.lag":
					dp := m.Data.(metricdata.Gauge[float64]).DataPoints
					require.Len(t, dp, 1)
					require.GreaterOrEqual(t, dp[0].Value, 0.0)
					require.Less(t, dp[0].Value, waitTimeout.Seconds())
					require.Equal(t, want, dp[0].Attributes)
					require.Equal(t, "s", m.Unit)
				default:
					continue
				}
				found[m.Name] = true
			}
		}
		require.Equal(t, map[string]bool{"onceflow.outbox.backlog": true, "onceflow.outbox.lag": true}, found)
	})
}

func TestRelay_SkipMigrateWithoutTablesFailsNamingMigrate(t *testing.T) {
	t.Parallel()
	db := testsvc.SQLite(t)
	r, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: newRecorder(), SkipMigrate: true})
	require.NoError(t, err)
	err = r.Run(context.Background())
	require.ErrorContains(t, err, "create it with Outbox.Migrate or onceflow migrate --outbox")
	require.ErrorIs(t, r.Run(context.Background()), outbox.ErrClosed)
	require.NoError(t, r.Close())
	ok, err := db.TableExists(context.Background(), "onceflow_queue_onceflow_outbox")
	require.NoError(t, err)
	require.False(t, ok, "SkipMigrate created a table")
}

// A relay started before anything created the outbox's tables creates them, and sends what is
// published afterwards: the relay and the router may start in either order.
func TestRelay_StartedFirstCreatesTheTablesAndSends(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			ctx := context.Background()
			rec := newRecorder()
			r, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: rec, PollInterval: 10 * time.Millisecond})
			require.NoError(t, err)
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			defer func() {
				require.NoError(t, r.Close())
				require.NoError(t, <-done)
			}()

			// The publisher never migrates: its publishes fail (and roll back) until the relay
			// has created the tables.
			ob, err := outbox.New(db, outbox.Config{})
			require.NoError(t, err)
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				tx, err := db.BeginTx(ctx, nil)
				require.NoError(c, err)
				err = ob.PublishTx(ctx, tx, "orders", message.NewMessage("first", []byte("{}")))
				if err != nil {
					_ = tx.Rollback()
				}
				require.NoError(c, err, "the relay has not created the tables")
				require.NoError(c, tx.Commit())
			}, waitTimeout, 10*time.Millisecond)
			got := rec.waitFor(t, 1)
			require.Equal(t, "first", got[0].msg.UUID)
		})
	}
}

func TestRelay_RunEndsWhenItsContextEnds(t *testing.T) {
	t.Parallel()
	e := setup(t, testsvc.Databases()[0], outbox.Config{})
	ids := e.commitN(t, "order", 2)
	rec := newRecorder()
	r, err := outbox.NewRelay(relayConfig(e, e.db, rec))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	rec.waitFor(t, 2)
	waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(waitTimeout):
		t.Fatal("Run did not return after its context ended")
	}
	require.Equal(t, ids, rec.ids())
	require.NoError(t, r.Close())
}

func TestNewRelay_RejectsInvalidConfigNamingTheField(t *testing.T) {
	t.Parallel()
	db := testsvc.SQLite(t)
	valid := outbox.RelayConfig{DB: db, Publisher: newRecorder()}
	for field, mutate := range map[string]func(c *outbox.RelayConfig){
		"DB":             func(c *outbox.RelayConfig) { c.DB = nil },
		"Publisher":      func(c *outbox.RelayConfig) { c.Publisher = nil },
		"Table":          func(c *outbox.RelayConfig) { c.Table = "no-dashes" },
		"ConsumerGroup":  func(c *outbox.RelayConfig) { c.ConsumerGroup = strings.Repeat("g", 256) },
		"BatchSize":      func(c *outbox.RelayConfig) { c.BatchSize = 10001 },
		"PollInterval":   func(c *outbox.RelayConfig) { c.PollInterval = -time.Second },
		"ResendInterval": func(c *outbox.RelayConfig) { c.ResendInterval = -time.Second },
		"RetryInterval":  func(c *outbox.RelayConfig) { c.RetryInterval = -time.Second },
		"AckDeadline":    func(c *outbox.RelayConfig) { c.AckDeadline = time.Microsecond },
		"CloseTimeout":   func(c *outbox.RelayConfig) { c.CloseTimeout = -time.Second },
		"MaxAttempts":    func(c *outbox.RelayConfig) { c.MaxAttempts = -1 },
		"PurgeBatchSize": func(c *outbox.RelayConfig) { c.PurgeBatchSize = -1 },
		"MaxResendInterval": func(c *outbox.RelayConfig) {
			c.MaxResendInterval = -time.Second
		},
	} {
		cfg := valid
		mutate(&cfg)
		_, err := outbox.NewRelay(cfg)
		require.ErrorContains(t, err, "outbox.NewRelay: "+field+": ", field)
	}
	r, err := outbox.NewRelay(valid)
	require.NoError(t, err)
	require.Equal(t, outbox.DefaultTable, r.Table())
	require.Equal(t, outbox.DefaultConsumerGroup, r.ConsumerGroup())
	require.NoError(t, r.Close())
	require.ErrorIs(t, r.Run(context.Background()), outbox.ErrClosed)
}

func TestRelay_CloseRacingRunStopsPromptly(t *testing.T) {
	t.Parallel()
	e := setup(t, testsvc.Databases()[0], outbox.Config{})
	for range 20 {
		cfg := relayConfig(e, e.db, newRecorder())
		cfg.CloseTimeout = time.Minute // a stall would show
		r, err := outbox.NewRelay(cfg)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- r.Run(context.Background()) }()
		began := time.Now()
		require.NoError(t, r.Close())
		select {
		case err := <-done:
			if err != nil {
				require.ErrorIs(t, err, outbox.ErrClosed)
			}
		case <-time.After(waitTimeout):
			t.Fatal("Run did not return after Close")
		}
		require.Less(t, time.Since(began), 5*time.Second)
	}
}

// A relay keeps its batch open while the destination takes a message. A processor that
// publishes meanwhile must not wait for it: a destination whose consumers publish to the
// outbox while they hold a lock of the destination (the embedded queue's write lock) would
// otherwise wait for the relay, and the relay for them, until the destination's ack deadline
// broke the cycle, one message per deadline.
func TestRelay_PublishDoesNotWaitForTheBatchBeingSent(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		rec := newRecorder()
		sending := make(chan struct{})
		release := make(chan struct{})
		rec.before = func(_ *message.Message, attempt int) error {
			select {
			case <-sending:
			default:
				close(sending)
				<-release
			}
			return nil
		}
		r := start(t, relayConfig(e, open(t, e.url), rec))
		released := false
		defer func() {
			if !released {
				close(release)
			}
		}()
		first := e.commitN(t, "first", 1)
		select {
		case <-sending:
		case <-time.After(waitTimeout):
			t.Fatal("the relay did not send the first message")
		}

		// The relay holds its batch, which reached the end of the outbox, open.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		second := outbox.DerivedID("second", "shipped")
		require.NoError(t, e.process(ctx, "second", nil, message.NewMessage(second, []byte("second"))),
			"publishing waited for the relay's batch")

		close(release)
		released = true
		rec.waitFor(t, 2)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))
		require.Equal(t, []string{first[0], second}, rec.ids())
	})
}
