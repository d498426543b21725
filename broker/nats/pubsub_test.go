package nats_test

import (
	"context"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestPubSub runs watermill's universal Pub/Sub suite against the subscriber, with package
// broker's publisher (watermill-nats's) on the shared server. Each constructor call makes a
// Subscriber with a connection of its own, as separate processes would have.
//
// Features:
//   - ConsumerGroups is true: each group has a durable consumer of its own, and the
//     subscriptions of one group compete for its messages.
//   - ExactlyOnceDelivery is false: delivery is at-least-once. A delivery given back (by
//     Close, a lost connection, a passed AckWait) is delivered again even if its consumer
//     processed it; onceflow's deduplication makes the processing exactly-once. With it false
//     the suite also runs TestContinueAfterSubscribeClose and TestConcurrentClose.
//   - GuaranteedOrder is false: many deliveries are in flight at once, a nacked message comes
//     back after the ones behind it, and competing subscriptions interleave. This skips
//     TestPublishSubscribeInOrder and TestNoAck, which demand one delivery at a time.
//   - Persistent is true: JetStream stores the messages in a file-backed stream.
//   - NewSubscriberReceivesOldMessages is false: a new subscription of a group starts at the
//     group's position; the stream is not replayed for each subscriber.
//   - RestartServiceCommand is empty, so TestReconnect is skipped: the NATS server is shared
//     with other tests and is not restarted. TestSubscriber_LostConnectionEndsTheDeliveriesInFlightAndTheSubscriptionGoesOn
//     cuts the connection through a proxy instead.
//   - ContextPreserved is false: a message's context is not carried over the wire.
//
// The suite runs twice: with a consumer that only acks and nacks, and with one that also tells
// the subscriber of each ack and nack (redelivery.WithDirectSettle, see testsvc.Settler).
func TestPubSub(t *testing.T) {
	t.Parallel()
	testsvc.ForEachSettleMode(t, "", true, testPubSub)
}

func testPubSub(t *testing.T, direct bool) {
	rawURL := testsvc.NATSURL(t)
	var mu sync.Mutex
	topics := map[string]bool{}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for topic := range topics {
			testsvc.RemoveTopics(t, rawURL, nil, topic)
		}
	})
	record := func(topic string) {
		mu.Lock()
		topics[topic] = true
		mu.Unlock()
	}
	withGroup := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		b, err := broker.Open(context.Background(), rawURL, broker.Options{})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, b.Close()) })
		s, err := natsbroker.NewSubscriber(natsbroker.Config{URL: rawURL, ConsumerGroup: group})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, s.Close()) })
		return recordingPublisher{b.Publisher(), record}, &recordingSubscriber{Subscriber: s, record: record, direct: direct, t: t}
	}
	testsvc.PubSub(t, "", withGroup)
}

// recordingPublisher and recordingSubscriber note the topics the suite uses, for the cleanup.
type recordingPublisher struct {
	message.Publisher
	record func(topic string)
}

func (p recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.record(topic)
	return p.Publisher.Publish(topic, msgs...)
}

// recordingSubscriber subscribes as a consumer that settles each message itself when direct
// is set (see testsvc.Settler).
type recordingSubscriber struct {
	*natsbroker.Subscriber
	record  func(topic string)
	direct  bool
	t       *testing.T
	settler testsvc.Settler
}

func (s *recordingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.record(topic)
	if !s.direct {
		return s.Subscriber.Subscribe(ctx, topic)
	}
	ch, err := s.Subscriber.Subscribe(redelivery.WithDirectSettle(ctx), topic)
	if err != nil {
		return nil, err
	}
	return s.settler.Settling(s.t, ch), nil
}

// Close closes the Subscriber and returns once the channels of its subscriptions are closed.
func (s *recordingSubscriber) Close() error {
	err := s.Subscriber.Close()
	s.settler.Wait()
	return err
}
