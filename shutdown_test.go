package onceflow_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// runRouter starts r and returns a function that stops it by cancelling Run's context.
func runRouter(t *testing.T, r *onceflow.Router) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	}
	return func() error { cancel(); return <-done }
}

func TestClose_LetsMessagesInFlightCommitAndAck(t *testing.T) {
	db := testsvc.SQLite(t)
	createEffects(t, db)
	b := brokertest.New()
	defer b.Close()
	entered := make(chan struct{})
	proceed := make(chan struct{})
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: -1, CloseTimeout: 10 * time.Second})
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: b.Subscriber(), DB: db, QoS: onceflow.ExactlyOnce,
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			close(entered)
			<-proceed
			return applyEffect(ctx, msg)
		}),
	}))
	stop := runRouter(t, r)
	f := &fixture{db: db, broker: b}
	f.publish(t, "in-flight", "x")
	<-entered

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("Close returned while a message was in flight: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(proceed)
	require.NoError(t, <-stopped)

	require.Equal(t, 1, b.Acks("in-flight"))
	require.Equal(t, 0, b.Nacks("in-flight"))
	require.Equal(t, 1, countEffects(t, db, "in-flight"))
}

func TestClose_NeverAcksAnUncommittedMessage(t *testing.T) {
	db := testsvc.SQLite(t)
	createEffects(t, db)
	b := brokertest.New()
	defer b.Close()
	entered := make(chan struct{})
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: -1, CloseTimeout: 50 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: b.Subscriber(), DB: db, QoS: onceflow.ExactlyOnce,
		Retry: middleware.Retry{MaxAttempts: 1},
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if err := applyEffect(ctx, msg); err != nil {
				return err
			}
			close(entered)
			<-ctx.Done() // outlives the close timeout; the subscription's end cancels it
			return ctx.Err()
		}),
	}))
	stop := runRouter(t, r)
	f := &fixture{db: db, broker: b}
	f.publish(t, "slow", "x")
	<-entered

	require.NoError(t, stop())

	require.Equal(t, 0, b.Acks("slow"))
	require.Equal(t, 0, countEffects(t, db, "slow"))
	require.Equal(t, 0, countDedup(t, db, "slow"))
	// The message comes back at once when the subscription's end reached the broker first,
	// after the router's redelivery delay when its nack did.
	var redelivered []*message.Message
	testsvc.Eventually(t, 10*time.Second, func() bool {
		redelivered = append(redelivered, b.Drain(topic)...)
		return len(redelivered) > 0
	}, "the broker does not have the message back")
	require.Len(t, redelivered, 1, "the broker still has the message, once")
	require.Equal(t, "slow", redelivered[0].UUID)
}

func TestRouterPurgeLoop_RemovesExpiredKeys(t *testing.T) {
	db := testsvc.SQLite(t)
	createEffects(t, db)
	b := brokertest.New()
	defer b.Close()
	store, err := dedup.New(db, dedup.Config{Retention: time.Hour, Now: func() time.Time { return time.Now().Add(-2 * time.Hour) }})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	tx, err := db.Beginx()
	require.NoError(t, err)
	_, err = store.Record(context.Background(), tx, dedup.Key{Handler: "effects", MessageID: "expired"}, "")
	require.NoError(t, err)
	require.NoError(t, tx.Commit())

	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: b.Subscriber(), DB: db, QoS: onceflow.ExactlyOnce, Processor: processor.Func(applyEffect),
	}))
	stop := runRouter(t, r)
	defer func() { require.NoError(t, stop()) }()
	f := &fixture{db: db, broker: b}
	f.publish(t, "live", "x")
	f.waitAcks(t, "live", 1)

	testsvc.Eventually(t, 10*time.Second, func() bool { return countDedup(t, db, "expired") == 0 }, "the purge loop did not remove the expired key")
	require.Equal(t, 1, countDedup(t, db, "live"))
}

func TestRun_WithoutHandlersRunsUntilItsContextEnds(t *testing.T) {
	b := brokertest.New()
	defer b.Close()
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: -1})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	select {
	case err := <-done:
		t.Fatalf("Run returned before its context ended: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	cancel()
	require.NoError(t, <-done)
}

func TestRun_EndsWhenItsSubscriptionsEnd(t *testing.T) {
	db := testsvc.SQLite(t)
	createEffects(t, db)
	b := brokertest.New()
	defer b.Close()
	sub := b.Subscriber()
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b, PurgeInterval: -1})
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "effects", Topic: topic, Subscriber: sub, DB: db, QoS: onceflow.ExactlyOnce, Concurrency: 2,
		Processor: processor.Func(applyEffect),
	}))
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	require.NoError(t, sub.Close()) // the subscriber ends its message channels by itself
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its subscriptions ended")
	}
}
