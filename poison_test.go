package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// deadLetters returns the messages waiting on the router's dead-letter topic, taking them.
func (f *fixture) deadLetters() []*message.Message {
	return f.broker.Drain(onceflow.DefaultDeadLetterTopic)
}

func TestPanickingMessage_IsDeadLetteredAtTheDeliveryLimitAndStarvesNobody(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		var mu sync.Mutex
		deliveries := map[string]int{}
		f.startRouter(t, onceflow.Handler{
			QoS:        onceflow.ExactlyOnce,
			DeadLetter: middleware.DeadLetter{MaxDeliveries: 3},
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				mu.Lock()
				deliveries[msg.ID]++
				mu.Unlock()
				if msg.ID == "poison" {
					panic("nil map")
				}
				return applyEffect(ctx, msg)
			}),
		})
		f.publish(t, "poison", "x")
		for i := range 20 {
			f.publish(t, fmt.Sprintf("good-%d", i), "x")
		}
		for i := range 20 {
			f.waitAcks(t, fmt.Sprintf("good-%d", i), 1)
			require.Equal(t, 1, countEffects(t, f.db, fmt.Sprintf("good-%d", i)))
		}
		f.waitAcks(t, "poison", 1)
		require.Equal(t, 2, f.broker.Nacks("poison"), "nacked twice, dead-lettered at the third delivery")
		mu.Lock()
		require.Equal(t, 3, deliveries["poison"])
		mu.Unlock()
		dead := f.deadLetters()
		require.Len(t, dead, 1)
		require.Equal(t, "poison", dead[0].UUID)
		require.Equal(t, "permanent: delivery limit reached after 3 deliveries: processor panicked: nil map", dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason))
		require.Equal(t, "3", dead[0].Metadata.Get(messagedata.HeaderDeadLetterDeliveries))
		require.Equal(t, 0, countEffects(t, f.db, "poison"))
		// The router told the broker of every ack and nack itself: no delivery waited on its
		// channels, and none was left unsettled.
		require.Equal(t, f.broker.TotalAcks()+f.broker.TotalNacks(), f.broker.DirectDeliveries())
	})
}

func TestDataError_IsDeadLetteredOnFirstSight(t *testing.T) {
	forEachDatabaseAndMode(t, func(t *testing.T, f *fixture) {
		_, err := f.db.Exec(`CREATE TABLE strict (v VARCHAR(5) NOT NULL)`)
		require.NoError(t, err)
		var calls atomic.Int32
		f.startRouter(t, onceflow.Handler{
			QoS: onceflow.ExactlyOnce,
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				calls.Add(1)
				tx, _ := processor.TxFromContext(ctx)
				var v any = string(msg.Payload)
				if msg.ID == "null" {
					v = nil
				}
				_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO strict (v) VALUES (?)`), v)
				return err
			}),
		})
		f.publish(t, "null", "x")
		f.waitAcks(t, "null", 1)
		require.Equal(t, int32(1), calls.Load(), "not retried in process")
		require.Equal(t, 0, f.broker.Nacks("null"), "not redelivered")
		dead := f.deadLetters()
		require.Len(t, dead, 1)
		require.Contains(t, strings.ToLower(dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason)), "null")
	})
}

func TestCrashLoop_OnABrokerThatDoesNotCountIsEndedByTheDurableCount(t *testing.T) {
	// A subscriber that says only whether a delivery is the first (a RabbitMQ classic queue):
	// each delivery of the message ends with its consumer gone, so no outcome is ever known.
	// The count in the database ends the loop. The second delivery runs with the others, as
	// any message a consumer held at its death does, and its death is not counted: the
	// deliveries run alone from the third on are, after the first.
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.broker.CountDeliveries = false
		var runs atomic.Int32
		for round := 1; round <= 5; round++ {
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1, CloseTimeout: 50 * time.Millisecond})
			require.NoError(t, err)
			entered := make(chan struct{}, 1)
			require.NoError(t, r.AddHandler(onceflow.Handler{
				Name: "effects", Topic: topic, Subscriber: f.broker.Subscriber(), DB: f.db, QoS: onceflow.ExactlyOnce,
				DeadLetter: middleware.DeadLetter{MaxDeliveries: 3},
				Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					runs.Add(1)
					entered <- struct{}{}
					<-ctx.Done() // the consumer "dies" while processing it
					return ctx.Err()
				}),
			}))
			stop := runRouter(t, r)
			if round == 1 {
				f.publish(t, "killer", "x")
			}
			if round <= 4 {
				<-entered
				require.NoError(t, stop())
				continue
			}
			f.waitAcks(t, "killer", 1)
			require.NoError(t, stop())
		}
		require.Equal(t, int32(4), runs.Load(), "the fifth delivery is dead-lettered without running")
		dead := f.deadLetters()
		require.Len(t, dead, 1)
		require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "delivery limit reached after 3 deliveries: the last one ended without an outcome")
		deliveries, attempts, grouped := f.counted(t, "killer")
		require.Equal(t, 5, deliveries)
		require.Equal(t, 3, attempts, "the third, fourth and fifth deliveries, run alone")
		require.Equal(t, 4, grouped, "the second delivery ran with others, the later ones could not")
	})
}

// counted returns the deliveries, the attempts and the grouped runs that the durable counter
// holds for the message with id.
func (f *fixture) counted(t *testing.T, id string) (deliveries, attempts, grouped int) {
	t.Helper()
	row := f.db.QueryRow(f.db.Rebind(`SELECT deliveries, attempts, grouped FROM `+dedup.DefaultCounterTable+` WHERE message_id = ?`), id)
	require.NoError(t, row.Scan(&deliveries, &attempts, &grouped))
	return deliveries, attempts, grouped
}

// window is how many messages the consumers of the window tests hold at once.
const window = 8

// windowIDs are the messages of the window tests.
func windowIDs() []string {
	ids := make([]string, window)
	for i := range ids {
		ids[i] = fmt.Sprintf("window-%d", i)
	}
	return ids
}

// runWindow runs one consumer of f's window messages until it dies holding them (die), or
// until it has acknowledged them all, and returns the sizes of the groups it processed. Its
// groups hold up to the window, and wait up to wait for it to fill.
func (f *fixture) runWindow(t *testing.T, wait time.Duration, die bool) []int {
	t.Helper()
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1, CloseTimeout: 50 * time.Millisecond})
	require.NoError(t, err)
	var mu sync.Mutex
	var sizes []int
	held := make(chan struct{}, 1)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: f.broker.Subscriber(), DB: f.db, QoS: onceflow.ExactlyOnce,
		DeadLetter:  middleware.DeadLetter{MaxDeliveries: 3},
		Concurrency: 1,
		GroupCommit: onceflow.GroupCommitConfig{MaxSize: window, MaxWait: wait},
		BatchProcessor: processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			mu.Lock()
			sizes = append(sizes, len(msgs))
			mu.Unlock()
			if die {
				held <- struct{}{}
				<-ctx.Done() // the consumer "dies" with the group in hand
				return ctx.Err()
			}
			return insertEffects(ctx, msgs)
		}),
	}))
	stop := runRouter(t, r)
	if die {
		<-held
	} else {
		for _, id := range windowIDs() {
			f.waitAcks(t, id, 1)
		}
	}
	require.NoError(t, stop())
	mu.Lock()
	defer mu.Unlock()
	return sizes
}

// newWindowFixture returns a fixture whose broker counts no deliveries (a RabbitMQ classic
// queue: the router counts them) and lets a consumer hold the window, with the window's
// messages published.
func newWindowFixture(t *testing.T) *fixture {
	f := newFixture(t, testsvc.Databases()[0])
	f.broker.CountDeliveries = false
	f.broker.Prefetch = window
	for _, id := range windowIDs() {
		f.publish(t, id, `{"amount": 1}`)
	}
	return f
}

func TestRedeliveriesAfterOneDeath_RunInGroupsAsTheirFirstDeliveriesDid(t *testing.T) {
	// A consumer dies holding a window of messages: they all come back redelivered. Any of
	// them may have killed it, none has killed two consumers: the next one runs them in a
	// group, not one at a time, and records no attempt (none failed of its own).
	f := newWindowFixture(t)
	require.Equal(t, []int{window}, f.runWindow(t, 10*time.Second, true), "the consumer dies holding the window")
	require.Equal(t, []int{window}, f.runWindow(t, 10*time.Second, false), "the redeliveries run in one group")
	for _, id := range windowIDs() {
		require.Equal(t, 1, countEffects(t, f.db, id), id)
		deliveries, attempts, grouped := f.counted(t, id)
		require.Equal(t, 2, deliveries, id)
		require.Zero(t, attempts, id)
		require.Equal(t, 1, grouped, id)
	}
	require.Empty(t, f.deadLetters())
}

func TestRedeliveriesAfterTwoDeaths_RunOneAtATimeAndCountOnlyTheirOwnAttempts(t *testing.T) {
	// Two consumers die holding the same messages, the second with them in its group: from
	// their third delivery on they run alone, so that the one that kills its consumer takes no
	// other with it, and each records the attempt it runs alone. The deaths they did not run
	// alone at are not counted against them: none is given up.
	f := newWindowFixture(t)
	require.Equal(t, []int{window}, f.runWindow(t, 10*time.Second, true), "the first consumer dies holding the window")
	require.Equal(t, []int{window}, f.runWindow(t, 10*time.Second, true), "the second dies with it in one group")
	require.Equal(t, slices.Repeat([]int{1}, window), f.runWindow(t, 0, false), "the third runs them one at a time")
	for _, id := range windowIDs() {
		require.Equal(t, 1, countEffects(t, f.db, id), id)
		deliveries, attempts, grouped := f.counted(t, id)
		require.Equal(t, 3, deliveries, id)
		require.Equal(t, 1, attempts, id)
		require.Equal(t, 2, grouped, id)
	}
	require.Empty(t, f.deadLetters())
}

func TestRedelivery_WaitsTheDelayOfItsDeliveryCount(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	var mu sync.Mutex
	var at []time.Time
	f.startRouter(t, onceflow.Handler{
		QoS:        onceflow.ExactlyOnce,
		Retry:      middleware.Retry{MaxAttempts: 1},
		Redelivery: onceflow.RedeliveryConfig{Delays: []time.Duration{100 * time.Millisecond, 300 * time.Millisecond}},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			mu.Lock()
			at = append(at, time.Now())
			n := len(at)
			mu.Unlock()
			if n < 4 {
				return errors.New("not yet")
			}
			return applyEffect(ctx, msg)
		}),
	})
	f.publish(t, "m", "x")
	f.waitAcks(t, "m", 1)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, at, 4)
	for i, want := range []time.Duration{100 * time.Millisecond, 300 * time.Millisecond, 300 * time.Millisecond} {
		require.GreaterOrEqual(t, at[i+1].Sub(at[i]), want, "wait after delivery %d", i+1)
	}
}

func TestRedelivery_OnASubscriberThatCannotDelayTheRouterHoldsTheMessageAndCloseLetsItGo(t *testing.T) {
	f := newFixture(t, testsvc.Databases()[0])
	f.broker.CountDeliveries = false
	var calls atomic.Int32
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1, CloseTimeout: 10 * time.Second})
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: f.broker.Subscriber(), DB: f.db, QoS: onceflow.ExactlyOnce,
		Retry:      middleware.Retry{MaxAttempts: 1},
		Redelivery: onceflow.RedeliveryConfig{Delays: []time.Duration{time.Hour}},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			calls.Add(1)
			return errors.New("fails")
		}),
	}))
	stop := runRouter(t, r)
	f.publish(t, "held", "x")
	testsvc.Eventually(t, 5*time.Second, func() bool { return calls.Load() == 1 }, "not processed")
	time.Sleep(50 * time.Millisecond) // a nack in this time would show
	require.Equal(t, 0, f.broker.Nacks("held"), "held for its delay, not nacked")
	start := time.Now()
	require.NoError(t, stop())
	require.Less(t, time.Since(start), 5*time.Second, "Close does not wait out the hour")
	require.GreaterOrEqual(t, f.broker.Nacks("held"), 1, "given back when the router closed (and nacked again while it closed)")
	require.Equal(t, 0, f.broker.Acks("held"))
}

func TestHandlerName_UsedForAnotherTopicByAnotherProcessFailsAtStart(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		start := func(topicName string) error {
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: f.broker, PurgeInterval: -1})
			require.NoError(t, err)
			require.NoError(t, r.AddHandler(onceflow.Handler{
				Name: "billing", Topic: topicName, Subscriber: f.broker.Subscriber(), DB: f.db, QoS: onceflow.ExactlyOnce,
				Processor: processor.Func(applyEffect),
			}))
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			select {
			case <-r.Running():
				cancel()
				return <-done
			case err := <-done:
				cancel()
				return err
			}
		}
		require.NoError(t, start("invoices"))
		require.NoError(t, start("invoices"), "the same topic again is fine")
		err := start("refunds")
		require.ErrorIs(t, err, dedup.ErrHandlerTopic)
		require.ErrorContains(t, err, `"refunds"`)
		require.ErrorContains(t, err, `"invoices"`)
	})
}

func TestDeadLetter_WhoseAckIsLostOnABrokerThatDoesNotCountIsNotPublishedAgain(t *testing.T) {
	// A subscriber that says only whether a delivery is the first (a RabbitMQ classic queue).
	// The first delivery is dead-lettered and recorded, and its acknowledgement is lost; the
	// redelivery is the second delivery, which the record acknowledges without a second dead
	// letter.
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		f.broker.CountDeliveries = false
		var lost atomic.Bool
		var deliveries []int
		var mu sync.Mutex
		loseAck := onceflow.Use("lose-ack", func(next processor.Processor) processor.Processor {
			return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				mu.Lock()
				deliveries = append(deliveries, msg.Delivery)
				mu.Unlock()
				err := next.Process(ctx, msg)
				if processor.IsDeadLettered(err) && lost.CompareAndSwap(false, true) {
					return errors.New("the acknowledgement was lost") // the router nacks
				}
				return err
			})
		})
		f.startRouter(t, onceflow.Handler{
			Chain: onceflow.ExactlyOnce.Chain().Before(onceflow.StageDeadLetter, loseAck),
			Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				return processor.Permanent(errors.New("rejected by a business rule"))
			}),
		})
		f.publish(t, "rejected", "x")
		f.waitAcks(t, "rejected", 1)

		require.Equal(t, 1, f.broker.Nacks("rejected"), "the delivery whose acknowledgement was lost")
		mu.Lock()
		require.Equal(t, []int{1, 2}, deliveries, "the redelivery is counted as the second delivery")
		mu.Unlock()
		dead := f.deadLetters()
		require.Len(t, dead, 1, "one dead letter")
		require.Equal(t, "1", dead[0].Metadata.Get(messagedata.HeaderDeadLetterDeliveries))
	})
}

func TestDeliveryWhoseAttemptCannotBeRecorded_IsNotGivenUpOnTheBrokersCount(t *testing.T) {
	// The router records the attempt of a message's second redelivery and later ones before
	// processing them, and gives a message up on the attempts, not on the broker's count,
	// which includes deliveries that never began. When the attempt cannot be recorded (here
	// the counter table lost its column; in production the database is unreachable), the
	// limit does not apply to that delivery. (The first redelivery, run with others, is taken
	// to have begun, as the first delivery is: a limit of 2 would give it up.)
	f := newFixture(t, testsvc.Databases()[0]) // sqlite
	var calls atomic.Int32
	f.startRouter(t, onceflow.Handler{
		QoS:        onceflow.ExactlyOnce,
		DeadLetter: middleware.DeadLetter{MaxDeliveries: 3},
		Retry:      middleware.Retry{MaxAttempts: 1},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if calls.Add(1) < 5 {
				return errors.New("not yet")
			}
			return applyEffect(ctx, msg)
		}),
	})
	_, err := f.db.Exec(`ALTER TABLE ` + dedup.DefaultCounterTable + ` DROP COLUMN attempts`)
	require.NoError(t, err)

	f.publish(t, "late", "x")
	f.waitAcks(t, "late", 1)
	require.Equal(t, int32(5), calls.Load(), "retried past the limit, whose count was unknown")
	require.Equal(t, 4, f.broker.Nacks("late"))
	require.Equal(t, 1, countEffects(t, f.db, "late"))
	require.Empty(t, f.deadLetters())
}
