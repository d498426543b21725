// Package kafkatest gives tests a Kafka cluster to talk to over TCP with the real client: by
// default an in-process cluster of three brokers on loopback (franz-go's kfake, which speaks
// the Kafka protocol and keeps the records in memory), one per call; with the environment
// variable ONCEFLOW_TEST_KAFKA set to seed brokers ("host:9092,host2:9092"), that cluster,
// shared by every call (tests use topics and groups of their own names).
//
// kfake implements the consumer group protocol, offsets, idempotent produce and topic
// creation as a Kafka broker does, but it is not Kafka: a test that passes against it has not
// been run against a real cluster until it runs with ONCEFLOW_TEST_KAFKA.
package kafkatest

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Env is the environment variable that points the tests at a real cluster.
const Env = "ONCEFLOW_TEST_KAFKA"

// Partitions is the partition count of the topics that the in-process cluster creates when
// asked for the default.
const Partitions = 4

// Brokers returns the seed brokers of a cluster for t: ONCEFLOW_TEST_KAFKA's, or those of a
// new in-process cluster that is closed when t ends.
func Brokers(t testing.TB) []string {
	t.Helper()
	if v := strings.TrimSpace(os.Getenv(Env)); v != "" {
		return strings.Split(v, ",")
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.DefaultNumPartitions(Partitions),
		// Tests run with session timeouts below Kafka's minimum (6 s), so that the
		// partitions of a member that dies move in about a second.
		kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		t.Fatalf("kafkatest: start an in-process Kafka cluster: %v", err)
	}
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

// URL returns the kafka:// URL of a cluster for t (see Brokers), with query appended when it
// is not empty ("partitions=2").
func URL(t testing.TB, query string) string {
	t.Helper()
	u := "kafka://" + strings.Join(Brokers(t), ",") + "/"
	if query != "" {
		u += "?" + query
	}
	return u
}

// Real reports whether the tests run against a real cluster (ONCEFLOW_TEST_KAFKA is set).
func Real() bool { return strings.TrimSpace(os.Getenv(Env)) != "" }
