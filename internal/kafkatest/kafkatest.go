// Package kafkatest gives the project's tests a Kafka cluster to talk to over TCP with the real
// client: by default an in-process cluster of package broker/kafka/kafkatest (franz-go's kfake),
// one per call; with the environment variable ONCEFLOW_TEST_KAFKA set to seed brokers
// ("host:9092,host2:9092"), that cluster, shared by every call (tests use topics and groups of
// their own names). It adds what the project's tests need beside the public package: the real
// cluster, rebalance counts, and whether a group has settled.
package kafkatest

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceflow/onceflow/broker/kafka/kafkatest"
)

// Env is the environment variable that points the tests at a real cluster.
const Env = "ONCEFLOW_TEST_KAFKA"

// Brokers returns the seed brokers of a cluster for t: ONCEFLOW_TEST_KAFKA's, or those of a
// new in-process cluster that is closed when t ends.
func Brokers(t testing.TB) []string {
	t.Helper()
	if v := strings.TrimSpace(os.Getenv(Env)); v != "" {
		return strings.Split(v, ",")
	}
	return kafkatest.New(t).Brokers()
}

// URL returns the kafka:// URL of a cluster for t (see Brokers), with query appended when it
// is not empty ("partitions=2").
func URL(t testing.TB, query string) string {
	t.Helper()
	return URLOf(Brokers(t), query)
}

// URLOf returns the kafka:// URL of the seed brokers, with query appended when it is not empty.
func URLOf(brokers []string, query string) string { return kafkatest.URLOf(brokers, query) }

// Rebalances counts the rebalances of the consumer groups of an in-process cluster: each
// generation that a group's members sync to is one (the first forming of a group included).
type Rebalances struct {
	mu   sync.Mutex
	seen map[string]map[int32]bool // group -> generations
}

// URLCountingRebalances is URL with the rebalances of the cluster's groups counted. On a real
// cluster (ONCEFLOW_TEST_KAFKA) nothing is counted and the Rebalances is nil.
func URLCountingRebalances(t testing.TB, query string) (string, *Rebalances) {
	t.Helper()
	if Real() {
		return URL(t, query), nil
	}
	c := kafkatest.New(t)
	r := &Rebalances{seen: map[string]map[int32]bool{}}
	// An observer: it returns false, so the cluster answers the request as it would anyway.
	c.ControlKey(int16(kmsg.SyncGroup), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		req := kreq.(*kmsg.SyncGroupRequest)
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.seen[req.Group] == nil {
			r.seen[req.Group] = map[int32]bool{}
		}
		r.seen[req.Group][req.Generation] = true
		return nil, nil, false
	})
	return c.URL(query), r
}

// Total is the number of rebalances counted over all groups.
func (r *Rebalances) Total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, gens := range r.seen {
		n += len(gens)
	}
	return n
}

// Real reports whether the tests run against a real cluster (ONCEFLOW_TEST_KAFKA is set).
func Real() bool { return strings.TrimSpace(os.Getenv(Env)) != "" }

// Settled reports whether the consumer group is stable with members members, each assigned
// partitions: records published from then on go to members that consume them, with no
// rebalance in between. Callers poll it until it holds or their deadline passes.
func Settled(ctx context.Context, admin *kadm.Client, group string, members int) bool {
	groups, err := admin.DescribeGroups(ctx, group)
	if err != nil {
		return false
	}
	g, ok := groups[group]
	if !ok || g.Err != nil || g.State != "Stable" || len(g.Members) != members {
		return false
	}
	for _, m := range g.Members {
		if a, ok := m.Assigned.AsConsumer(); !ok || len(a.Topics) == 0 {
			return false
		}
	}
	return true
}
