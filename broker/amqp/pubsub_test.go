package amqp_test

import (
	"context"
	"slices"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestPubSub runs watermill's universal Pub/Sub suite against the Subscriber, with
// watermill-amqp's publisher over the same topology (NewPublisher), on classic and on quorum
// queues.
//
// Features:
//   - ConsumerGroups is true: each group has its own queue, and every group gets every message.
//   - ExactlyOnceDelivery is false: delivery is at least once. A subscriber that closes gives
//     back what it was handed and did not ack, and RabbitMQ delivers it again. With it false the
//     suite also runs TestContinueAfterSubscribeClose and TestConcurrentClose.
//   - GuaranteedOrder is false: a subscription keeps up to Prefetch messages in flight, which a
//     consumer may settle in any order, a nacked one comes back behind later ones, and the
//     consumers of a group share the queue. So TestNoAck, which expects nothing to arrive while
//     one message is unacked, and TestPublishSubscribeInOrder are skipped.
//   - Persistent is true: queues are durable and messages persistent.
//   - NewSubscriberReceivesOldMessages is false: a queue is not a log; an acked message is gone.
//   - RestartServiceCommand is empty, so TestReconnect is skipped: the RabbitMQ of the tests is
//     shared with other tests and cannot be restarted; a lost connection is covered by
//     TestSubscriber_LostConnectionRedeliversWhatWasInFlightAndGoesOn, through a proxy.
//   - ContextPreserved is false: a message's context is not published.
//
// Each queue type runs it with a consumer that settles directly (the suite's acks and nacks
// are followed by redelivery.Settle, see settlingSubscriber); the classic queue also with one
// that does not (forEachQueueType says why one queue type is enough).
func TestPubSub(t *testing.T) {
	t.Parallel()
	for i, qt := range queueTypes {
		forEachMode(t, string(qt)+"-", i == 0, func(t *testing.T, direct bool) {
			url := testsvc.AMQPURL(t)
			rec := &topics{}
			t.Cleanup(func() { rec.remove(t, url) })
			withGroup := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
				topology := amqp.Topology{ConsumerGroup: group, Queue: amqp.Queue{Type: qt}}
				rec.addGroup(group)
				pub, err := amqp.NewPublisher(url, topology, nil)
				require.NoError(t, err)
				sub, err := amqp.NewSubscriber(amqp.Config{URL: url, Topology: topology})
				require.NoError(t, err)
				var s message.Subscriber = sub
				if direct {
					s = testsvc.NewSettlingSubscriber(sub)
				}
				return recordingPublisher{pub, rec}, recordingSubscriber{s, rec}
			}
			testsvc.PubSub(t, "", withGroup)
		})
	}
}

// topics records the topics and groups a test used, to remove their exchanges and queues.
type topics struct {
	mu     sync.Mutex
	names  []string
	groups []string
}

func (r *topics) add(topic string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !slices.Contains(r.names, topic) {
		r.names = append(r.names, topic)
	}
}

func (r *topics) addGroup(group string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !slices.Contains(r.groups, group) {
		r.groups = append(r.groups, group)
	}
}

func (r *topics) remove(t *testing.T, url string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	testsvc.RemoveTopics(t, url, r.groups, r.names...)
}

type recordingPublisher struct {
	message.Publisher
	rec *topics
}

func (p recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.rec.add(topic)
	return p.Publisher.Publish(topic, msgs...)
}

type recordingSubscriber struct {
	message.Subscriber
	rec *topics
}

func (s recordingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.rec.add(topic)
	return s.Subscriber.Subscribe(ctx, topic)
}
