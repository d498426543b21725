package broker_test

import (
	"testing"

	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/all"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// removeTopic removes what a test left on a shared server for topic, for every consumer group
// the tests use.
func removeTopic(t testing.TB, rawURL, topic string) {
	testsvc.RemoveTopics(t, rawURL, []string{broker.DefaultConsumerGroup, "billing", "shipping"}, topic)
}
