package kafka_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	kafkabroker "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestPubSub runs watermill's universal Pub/Sub suite against the publisher and subscriber, on
// one cluster (in-process, or the one ONCEFLOW_TEST_KAFKA names). Each constructor call makes a
// Publisher and a Subscriber with clients of their own, as separate processes would have; the
// subscribers of one test share the consumer group "test" unless the suite names one.
//
// Features:
//   - ConsumerGroups is true: the members of a group share the partitions of a topic, every
//     group gets every record.
//   - ExactlyOnceDelivery is false: delivery is at-least-once. A partition revoked while its
//     records are in flight, and a member that dies, leave their unacked records to the next
//     owner, which delivers them again. With it false the suite also runs
//     TestContinueAfterSubscribeClose and TestConcurrentClose.
//   - GuaranteedOrder is false: records of all partitions are in flight at once, a nacked
//     record comes back after the ones behind it, and the suite's messages, keyed by their
//     UUIDs, spread over the partitions. So TestNoAck and TestPublishSubscribeInOrder are
//     skipped.
//   - Persistent is true: the records stay in the topic's log.
//   - NewSubscriberReceivesOldMessages is false: a new member joins its group where the
//     group's offsets are; only a new group starts from the beginning of the topic.
//   - RestartServiceCommand is empty, so TestReconnect is skipped: the cluster is in-process.
//   - ContextPreserved is false: a message's context is not carried over the wire.
func TestPubSub(t *testing.T) {
	t.Parallel()
	brokers := kafkatest.Brokers(t)
	prefix := testsvc.UniqueName("pubsub")
	withGroup := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		pub, err := kafkabroker.NewPublisher(kafkabroker.PublisherConfig{Brokers: brokers})
		require.NoError(t, err)
		sub, err := kafkabroker.NewSubscriber(kafkabroker.Config{
			Brokers:       brokers,
			ConsumerGroup: group,
			NackDelay:     50 * time.Millisecond,
			// Members that the suite leaves open (it closes what it gets, not always at once)
			// must not hold partitions of later tests for long.
			SessionTimeout: time.Second,
			RevokeTimeout:  time.Second,
			ClientOptions:  fast,
		})
		require.NoError(t, err)
		return pub, sub
	}
	testsvc.PubSub(t, prefix, withGroup)
}
