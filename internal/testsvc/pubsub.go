package testsvc

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
)

// PubSub runs watermill's universal Pub/Sub suite with the features that every onceflow
// subscriber has: consumer groups, delivery at least once, no guaranteed order (a window of
// deliveries in flight), persistent messages, a new subscriber of a group starts at the
// group's position, and a message's context is not stored. withGroup makes a publisher and a
// subscriber of a group; the suite's subscribers without a group of their own are of the
// group "test". With topicPrefix, the suite's topics are named topicPrefix_<test id>, so that
// a cleanup can find them.
func PubSub(t *testing.T, topicPrefix string, withGroup func(t *testing.T, group string) (message.Publisher, message.Subscriber)) {
	t.Helper()
	pubSub(t, topicPrefix, false, withGroup)
}

// PubSubShort runs the suite as PubSub does, at the sizes of its short mode (100 messages where
// it sends 1,000 to 10,000): for a second configuration of a subscriber whose first runs the
// suite in full.
func PubSubShort(t *testing.T, topicPrefix string, withGroup func(t *testing.T, group string) (message.Publisher, message.Subscriber)) {
	t.Helper()
	pubSub(t, topicPrefix, true, withGroup)
}

func pubSub(t *testing.T, topicPrefix string, short bool, withGroup func(t *testing.T, group string) (message.Publisher, message.Subscriber)) {
	t.Helper()
	features := tests.Features{
		ForceShort:                       short,
		ConsumerGroups:                   true,
		ExactlyOnceDelivery:              false,
		GuaranteedOrder:                  false,
		Persistent:                       true,
		NewSubscriberReceivesOldMessages: false,
		ContextPreserved:                 false,
	}
	if topicPrefix != "" {
		features.GenerateTopicFunc = func(tctx tests.TestContext) string {
			return topicPrefix + "_" + string(tctx.TestID)
		}
	}
	tests.TestPubSub(t, features, func(t *testing.T) (message.Publisher, message.Subscriber) {
		return withGroup(t, "test")
	}, withGroup)
}
