package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

const topic = "orders"

// effects is the business table of these tests: one row per applied effect, deliberately
// without a unique key, so that a duplicate effect shows as a second row.
func createEffects(t *testing.T, db *sqldb.DB) {
	t.Helper()
	_, err := db.Exec(`CREATE TABLE effects (message_id VARCHAR(255) NOT NULL, note VARCHAR(255) NOT NULL)`)
	require.NoError(t, err)
}

func countEffects(t *testing.T, db *sqldb.DB, id string) int {
	t.Helper()
	var n int
	require.NoError(t, db.Get(&n, db.Rebind(`SELECT COUNT(*) FROM effects WHERE message_id = ?`), id))
	return n
}

func countDedup(t *testing.T, db *sqldb.DB, id string) int {
	t.Helper()
	var n int
	require.NoError(t, db.Get(&n, db.Rebind(`SELECT COUNT(*) FROM onceflow_dedup WHERE message_id = ?`), id))
	return n
}

// applyEffect is the processor of these tests: it writes one effect row in the transaction.
func applyEffect(ctx context.Context, msg *messagedata.MessageData) error {
	tx, ok := processor.TxFromContext(ctx)
	if !ok {
		return errors.New("no transaction")
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO effects (message_id, note) VALUES (?, ?)`), msg.ID, string(msg.Payload))
	return err
}

type fixture struct {
	db     *sqldb.DB
	broker *brokertest.Broker
	mode   mode
	// logger is the router's logger, when not nil.
	logger *slog.Logger
}

// mode is how a router test commits: one transaction per message, or group commit.
type mode struct {
	name string
	// companions is how many other messages a scenario publishes with its own in this mode,
	// so that the scenario's message shares its group's transaction with them.
	companions int
}

var modes = []mode{{name: "per-message"}, {name: "group-commit", companions: 3}}

func (m mode) group() bool { return m.companions > 0 }

// handler returns h for the mode. Per message, group commit is off (GroupCommit.Disabled);
// with group commit, the transaction stage runs groups, the handler runs one subscription per
// message of a scenario, and a group starts when every message of the scenario has joined it,
// or after 100 ms. A fixture without a mode leaves h as the test wrote it.
func (m mode) handler(h onceflow.Handler) onceflow.Handler {
	if m.name == "" {
		return h
	}
	if !m.group() {
		if h.BatchProcessor == nil {
			h.GroupCommit.Disabled = true
		}
		return h
	}
	h.Concurrency = m.companions + 1
	if h.GroupCommit.MaxSize == 0 {
		h.GroupCommit.MaxSize = m.companions + 1
		h.GroupCommit.MaxWait = 100 * time.Millisecond
	}
	return h
}

func newFixture(t *testing.T, d testsvc.Database) *fixture {
	t.Helper()
	db := d.Open(t)
	createEffects(t, db)
	b := brokertest.New()
	t.Cleanup(func() { _ = b.Close() })
	return &fixture{db: db, broker: b}
}

func newModeFixture(t *testing.T, d testsvc.Database, m mode) *fixture {
	t.Helper()
	f := newFixture(t, d)
	f.mode = m
	return f
}

// startRouter runs a router with handler h (DB and Subscriber filled in when empty) until the
// test ends.
func (f *fixture) startRouter(t *testing.T, h onceflow.Handler, register ...func(*onceflow.Router)) *onceflow.Router {
	t.Helper()
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1, CloseTimeout: 5 * time.Second, Logger: f.logger})
	require.NoError(t, err)
	for _, reg := range register {
		reg(r)
	}
	if h.Name == "" {
		h.Name = "effects"
	}
	h.Topic = topic
	if h.DB == nil {
		h.DB = f.db
	}
	if h.Subscriber == nil {
		h.Subscriber = f.broker.Subscriber()
	}
	if h.Processor == nil && h.BatchProcessor == nil {
		h.Processor = processor.Func(applyEffect)
	}
	chain := h.Chain
	if len(chain.Names()) == 0 {
		chain = h.QoS.Chain()
	}
	if h.Retry.InitialInterval == 0 && slices.Contains(chain.Names(), onceflow.StageRetry) {
		h.Retry.InitialInterval = time.Millisecond
	}
	if h.Redelivery.Delays == nil && chain.QoS() != onceflow.BestEffort {
		h.Redelivery.Delays = []time.Duration{5 * time.Millisecond}
	}
	require.NoError(t, r.AddHandler(f.mode.handler(h)))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return r
}

func (f *fixture) publish(t *testing.T, id, payload string) {
	t.Helper()
	require.NoError(t, f.broker.Publish(topic, message.NewMessage(id, []byte(payload))))
}

// publishWithCompanions publishes the message id and, in group-commit mode, its companions at
// the same time: the handler has a subscription for each, so they are processed in one group.
// Companions carry a payload that every processor of these tests accepts.
func (f *fixture) publishWithCompanions(t *testing.T, id, payload string) {
	t.Helper()
	for i := range f.mode.companions {
		f.publish(t, companionID(id, i), `{"amount": 1}`)
	}
	f.publish(t, id, payload)
}

func companionID(id string, i int) string { return fmt.Sprintf("%s-companion-%d", id, i+1) }

func isCompanion(msg *messagedata.MessageData) bool { return strings.Contains(msg.ID, "-companion-") }

// checkCompanions waits for the companions of id to be acked and checks that each was applied
// effects times: whatever happened to id in their group did not spill over to them.
func (f *fixture) checkCompanions(t *testing.T, id string, effects int) {
	t.Helper()
	for i := range f.mode.companions {
		c := companionID(id, i)
		f.waitAcks(t, c, 1)
		require.Equal(t, effects, countEffects(t, f.db, c), c)
	}
}

func (f *fixture) waitAcks(t *testing.T, id string, n int) {
	t.Helper()
	testsvc.Eventually(t, 15*time.Second, func() bool { return f.broker.Acks(id) >= n }, "message %s not acked %d times (acks %d, nacks %d)", id, n, f.broker.Acks(id), f.broker.Nacks(id))
}

func forEachDatabase(t *testing.T, fn func(t *testing.T, d testsvc.Database)) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			fn(t, d)
		})
	}
}

// forEachDatabaseAndMode runs fn for every database, once with a transaction per message and
// once with group commit: the exactly-once scenarios hold in both.
func forEachDatabaseAndMode(t *testing.T, fn func(t *testing.T, f *fixture)) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		for _, m := range modes {
			t.Run(m.name, func(t *testing.T) {
				t.Parallel()
				fn(t, newModeFixture(t, d, m))
			})
		}
	})
}

func TestExactlyOnce_RedeliveryAfterCommitIsAckedWithoutSecondEffect(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		f.startRouter(t, onceflow.Handler{QoS: onceflow.ExactlyOnce})

		f.publishWithCompanions(t, "m-1", "first")
		f.waitAcks(t, "m-1", 1)
		// The broker delivers the same message again, as it does when the ack was lost.
		f.publish(t, "m-1", "first")
		f.waitAcks(t, "m-1", 2)

		require.Equal(t, 1, countEffects(t, f.db, "m-1"))
		require.Equal(t, 1, countDedup(t, f.db, "m-1"))
		require.Equal(t, 0, f.broker.Nacks("m-1"))
		f.checkCompanions(t, "m-1", 1)
	})
}

// loseFirstAck returns a chain of q without retry, with a stage before the transaction that,
// for the first delivery of every message, reports a failure after the transaction committed:
// what the router sees when the process dies between commit and ack, or the ack is lost.
func loseFirstAck(q onceflow.QoS) onceflow.Chain {
	var mu sync.Mutex
	seen := map[string]bool{}
	lose := onceflow.Use("lose-first-ack", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			mu.Lock()
			first := !seen[msg.ID]
			seen[msg.ID] = true
			mu.Unlock()
			if err == nil && first {
				return errors.New("connection to the broker lost after commit")
			}
			return err
		})
	})
	return q.Chain().Remove(onceflow.StageRetry).Before(onceflow.StageTransaction, lose)
}

func TestExactlyOnce_CrashBetweenCommitAndAckRedeliversAndAcksOnce(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		f.startRouter(t, onceflow.Handler{Chain: loseFirstAck(onceflow.ExactlyOnce)})

		f.publishWithCompanions(t, "m-2", "x")
		f.waitAcks(t, "m-2", 1)

		require.Equal(t, 1, f.broker.Nacks("m-2"), "the lost ack is a nack")
		require.Equal(t, 1, f.broker.Acks("m-2"))
		require.Equal(t, 1, countEffects(t, f.db, "m-2"))
		f.checkCompanions(t, "m-2", 1)
	})
}

func TestAtLeastOnce_CrashBetweenCommitAndAckDuplicatesTheEffect(t *testing.T) {
	// The same fault without duplicate detection: the "at least once" row of the delivery-guarantee table.
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		f.startRouter(t, onceflow.Handler{Chain: loseFirstAck(onceflow.AtLeastOnce)})

		f.publishWithCompanions(t, "m-3", "x")
		f.waitAcks(t, "m-3", 1)

		require.Equal(t, 2, countEffects(t, f.db, "m-3"))
		f.checkCompanions(t, "m-3", 2)
	})
}

func TestExactlyOnce_ProcessorErrorRollsBackEveryWriteAndRetryAppliesOnce(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		var attempts atomic.Int32
		var effectRowsSeenOnRetry atomic.Int32
		f.startRouter(t, onceflow.Handler{
			QoS:   onceflow.ExactlyOnce,
			Retry: middleware.Retry{MaxAttempts: 1}, // every failure goes back to the broker
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if isCompanion(msg) {
					return applyEffect(ctx, msg)
				}
				n := attempts.Add(1)
				if n == 2 {
					// The first attempt's writes, dedup row included, must be gone.
					var rows int
					tx, _ := processor.TxFromContext(ctx)
					if err := tx.GetContext(ctx, &rows, tx.Rebind(`SELECT COUNT(*) FROM effects WHERE message_id = ?`), msg.ID); err != nil {
						return err
					}
					effectRowsSeenOnRetry.Store(int32(rows))
				}
				if err := applyEffect(ctx, msg); err != nil {
					return err
				}
				if n == 1 {
					return errors.New("downstream service unavailable")
				}
				return nil
			}),
		})

		f.publishWithCompanions(t, "m-4", "x")
		f.waitAcks(t, "m-4", 1)

		require.Equal(t, int32(2), attempts.Load())
		require.Equal(t, int32(0), effectRowsSeenOnRetry.Load())
		require.Equal(t, 1, f.broker.Nacks("m-4"))
		require.Equal(t, 1, countEffects(t, f.db, "m-4"))
		require.Equal(t, 1, countDedup(t, f.db, "m-4"))
		f.checkCompanions(t, "m-4", 1)
	})
}

func TestExactlyOnce_InProcessRetryGetsFreshTransaction(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		var attempts atomic.Int32
		f.startRouter(t, onceflow.Handler{
			QoS:   onceflow.ExactlyOnce,
			Retry: middleware.Retry{MaxAttempts: 3},
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if err := applyEffect(ctx, msg); err != nil {
					return err
				}
				if !isCompanion(msg) && attempts.Add(1) < 3 {
					return fmt.Errorf("attempt %d fails", msg.Attempt)
				}
				return nil
			}),
		})

		f.publishWithCompanions(t, "m-5", "x")
		f.waitAcks(t, "m-5", 1)

		require.Equal(t, int32(3), attempts.Load())
		require.Equal(t, 0, f.broker.Nacks("m-5"), "retried in process, not through the broker")
		require.Equal(t, 1, countEffects(t, f.db, "m-5"))
		f.checkCompanions(t, "m-5", 1)
	})
}

func TestExactlyOnce_TwoRoutersProcessingCopiesAtOnceGiveOneEffect(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		// Both copies are held until both routers have one in hand, so they race into their
		// transactions at the same time.
		arrived := make(chan struct{}, 2)
		release := make(chan struct{})
		barrier := onceflow.Use("barrier", func(next processor.Processor) processor.Processor {
			return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				arrived <- struct{}{}
				<-release
				return next.Process(ctx, msg)
			})
		})
		chain := onceflow.ExactlyOnce.Chain().Before(onceflow.StageTransaction, barrier)
		f.startRouter(t, onceflow.Handler{Name: "effects", Chain: chain})
		f.startRouter(t, onceflow.Handler{Name: "effects", Chain: chain})

		f.publish(t, "m-6", "x")
		f.publish(t, "m-6", "x")
		for range 2 {
			select {
			case <-arrived:
			case <-time.After(10 * time.Second):
				t.Fatal("both copies were not delivered")
			}
		}
		close(release)
		f.waitAcks(t, "m-6", 2)

		require.Equal(t, 1, countEffects(t, f.db, "m-6"))
		require.Equal(t, 0, f.broker.Nacks("m-6"))
	})
}

func TestPanicInProcessor_IsNackedWithNothingCommitted(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		var calls atomic.Int32
		f.startRouter(t, onceflow.Handler{
			QoS: onceflow.ExactlyOnce,
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if err := applyEffect(ctx, msg); err != nil {
					return err
				}
				if !isCompanion(msg) && calls.Add(1) == 1 {
					panic("bug in processor")
				}
				return nil
			}),
		})

		f.publishWithCompanions(t, "m-7", "x")
		f.waitAcks(t, "m-7", 1)

		require.Equal(t, 1, f.broker.Nacks("m-7"), "the panic is a nack, not retried in process")
		require.Equal(t, int32(2), calls.Load())
		require.Equal(t, 1, countEffects(t, f.db, "m-7"))
		require.Equal(t, 1, countDedup(t, f.db, "m-7"))
		// The members of the panicking message's group committed, and were acked once.
		f.checkCompanions(t, "m-7", 1)
		for i := range f.mode.companions {
			require.Equal(t, 0, f.broker.Nacks(companionID("m-7", i)))
		}
	})
}

func TestMessageWithoutID_IsDeadLetteredWithReason(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		var calls atomic.Int32
		f.startRouter(t, onceflow.Handler{
			QoS: onceflow.ExactlyOnce,
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if msg.ID == "" {
					calls.Add(1)
				}
				return applyEffect(ctx, msg)
			}),
		})

		f.publishWithCompanions(t, "", "no id at all")
		f.waitAcks(t, "", 1)
		f.checkCompanions(t, "", 1)

		dead := f.broker.Drain(onceflow.DefaultDeadLetterTopic)
		require.Len(t, dead, 1)
		require.Equal(t, "no id at all", string(dead[0].Payload))
		require.NotEmpty(t, dead[0].UUID, "a dead letter gets an id so it can be replayed")
		require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), `message has no id (watermill uuid, header "onceflow_id" and AMQP message_id are empty)`)
		require.Equal(t, "effects", dead[0].Metadata.Get(messagedata.HeaderDeadLetterHandler))
		require.Equal(t, topic, dead[0].Metadata.Get(messagedata.HeaderDeadLetterTopic))
		require.Equal(t, int32(0), calls.Load())
		require.Equal(t, 0, f.broker.Nacks(""))
		require.Equal(t, 0, countEffects(t, f.db, ""))
	})
}

type order struct {
	Amount int `json:"amount"`
}

func TestMalformedJSONPayload_IsDeadLetteredNotRetried(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		var calls atomic.Int32
		f.startRouter(t, onceflow.Handler{
			QoS: onceflow.ExactlyOnce,
			Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, o order) error {
				if !isCompanion(msg) {
					calls.Add(1)
				}
				return applyEffect(ctx, msg)
			}),
		})

		f.publishWithCompanions(t, "m-8", `{"amount": "not a number"`)
		f.waitAcks(t, "m-8", 1)
		f.checkCompanions(t, "m-8", 1)

		dead := f.broker.Drain(onceflow.DefaultDeadLetterTopic)
		require.Len(t, dead, 1)
		require.Equal(t, "m-8", dead[0].UUID)
		require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "decode JSON payload")
		require.Equal(t, "1", dead[0].Metadata.Get(messagedata.HeaderDeadLetterAttempt))
		require.Equal(t, int32(0), calls.Load())
		require.Equal(t, 0, f.broker.Nacks("m-8"))
		require.Equal(t, 0, countEffects(t, f.db, "m-8"))
		require.Equal(t, 0, countDedup(t, f.db, "m-8"), "the dead-lettered message is not recorded: a replay is processed")
	})
}

// A BestEffort handler acks on receipt, and the subscriber then hands over the next message at
// once: the handler still processes at most Concurrency messages at a time, or it would take
// every message the broker holds, each with a database connection of its own.
func TestBestEffort_ProcessesAtMostConcurrencyMessagesAtOnce(t *testing.T) {
	t.Parallel()
	const concurrency, messages = 2, 12
	f := newFixture(t, testsvc.Databases()[0]) // sqlite
	var inflight, peak, done atomic.Int32
	release := make(chan struct{})
	f.startRouter(t, onceflow.Handler{
		Concurrency: concurrency,
		// No transaction: SQLite would make the deliveries take turns at its one writer.
		Chain: onceflow.BestEffort.Chain().Remove(onceflow.StageTransaction, onceflow.PartlyApplied),
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			n := inflight.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			<-release
			inflight.Add(-1)
			done.Add(1)
			return nil
		}),
	})
	for i := range messages {
		f.publish(t, fmt.Sprintf("best-effort-%d", i), `{}`)
	}

	testsvc.Eventually(t, 15*time.Second, func() bool { return inflight.Load() >= concurrency },
		"the processor never held %d messages at once", concurrency)
	require.Never(t, func() bool { return inflight.Load() > concurrency }, 200*time.Millisecond, 5*time.Millisecond,
		"more messages than Concurrency were processed at once")
	close(release)
	testsvc.Eventually(t, 15*time.Second, func() bool { return done.Load() == messages },
		"not every one of %d messages was processed", messages)
	require.EqualValues(t, concurrency, peak.Load())
	require.Equal(t, messages, f.broker.TotalAcks())
}

// handSubscriber is a subscriber whose deliveries the test hands over one by one, each with a
// context of the test's choosing.
type handSubscriber struct {
	out  chan *message.Message
	once sync.Once
}

func (s *handSubscriber) Subscribe(context.Context, string) (<-chan *message.Message, error) {
	return s.out, nil
}

func (s *handSubscriber) Close() error {
	s.once.Do(func() { close(s.out) })
	return nil
}

// settledWithin returns "ack" or "nack", whichever msg got first, or "" after timeout.
func settledWithin(msg *message.Message, timeout time.Duration) string {
	select {
	case <-msg.Acked():
		return "ack"
	case <-msg.Nacked():
		return "nack"
	case <-time.After(timeout):
		return ""
	}
}

func TestDeliveryThatEndsWhileWaitingForASlot_IsNackedWithoutProcessing(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testsvc.Databases()[0]) // sqlite
	sub := &handSubscriber{out: make(chan *message.Message)}
	started, release := make(chan string, 3), make(chan struct{})
	f.startRouter(t, onceflow.Handler{
		Chain:       onceflow.BestEffort.Chain().Remove(onceflow.StageTransaction, onceflow.PartlyApplied),
		Concurrency: 1,
		Subscriber:  sub,
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			started <- msg.ID
			<-release
			return nil
		}),
	})

	first := message.NewMessage("slot-first", []byte(`{}`))
	sub.out <- first
	require.Equal(t, "slot-first", startedWithin(t, started, 10*time.Second))
	// The only slot is taken: the next delivery waits for it, and its delivery ends meanwhile
	// (its ack deadline passed).
	ctx, cancel := context.WithCancel(context.Background())
	ended := message.NewMessage("slot-ended", []byte(`{}`))
	ended.SetContext(ctx)
	sub.out <- ended
	cancel()
	require.Equal(t, "nack", settledWithin(ended, 10*time.Second), "the delivery that ended while it waited")

	third := message.NewMessage("slot-third", []byte(`{}`))
	sub.out <- third
	close(release)
	require.Equal(t, "ack", settledWithin(first, 10*time.Second), "the first delivery")
	require.Equal(t, "ack", settledWithin(third, 10*time.Second), "the delivery after the one that ended")
	require.Equal(t, "slot-third", startedWithin(t, started, 10*time.Second))
	require.Empty(t, started, "a delivery that ended before its turn reached the processor")
}

// startedWithin returns the next id from started, failing t when none comes within timeout.
func startedWithin(t *testing.T, started <-chan string, timeout time.Duration) string {
	t.Helper()
	select {
	case id := <-started:
		return id
	case <-time.After(timeout):
		t.Fatal("no delivery reached the processor")
		return ""
	}
}
