// Package kafkatest runs an in-process Kafka cluster on loopback, so that the tests of a
// handler that uses a kafka:// broker need no Kafka server: franz-go's kfake, which speaks the
// Kafka protocol over TCP to the real client and keeps the records in memory. Package
// broker/kafka does not import it.
//
//	c := kafkatest.New(t) // closed when the test ends
//	b, err := broker.Open(ctx, c.URL(""), broker.Options{})
//
// kfake is not Kafka: a test that passes against it has not run against a real cluster. Its
// methods, which Cluster has, inject faults (ControlKey answers or drops a kind of request).
package kafkatest

import (
	"cmp"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Defaults of Config: each is the value of the field of its name when that field is zero.
const (
	DefaultBrokers           = 3
	DefaultPartitions        = 4
	DefaultMinSessionTimeout = 100 * time.Millisecond
)

// Config configures a Cluster. The zero value selects every default.
type Config struct {
	// Brokers is the number of brokers, each on a loopback port of its own. Defaults to
	// DefaultBrokers.
	Brokers int
	// Partitions is the partition count of the topics created without one (by the
	// broker/kafka publisher and subscribers, unless the URL sets partitions). Defaults to
	// DefaultPartitions.
	Partitions int
	// MinSessionTimeout is the shortest group session timeout the cluster accepts (Kafka's
	// group.min.session.timeout.ms, 6 s). Defaults to DefaultMinSessionTimeout, so that a test
	// with a short ack_timeout (the kafka:// session timeout) sees a dead member's partitions
	// move in about a second.
	MinSessionTimeout time.Duration
}

// Cluster is an in-process Kafka cluster listening on loopback. Close stops it and drops its
// records. It is safe for concurrent use.
type Cluster struct {
	*kfake.Cluster
}

// Start starts a cluster.
func Start(cfg Config) (*Cluster, error) {
	if cfg.Brokers < 0 || cfg.Partitions < 0 || cfg.MinSessionTimeout < 0 {
		return nil, fmt.Errorf("kafkatest: Config %+v: a negative field (0 selects the default)", cfg)
	}
	cfg.Brokers = cmp.Or(cfg.Brokers, DefaultBrokers)
	cfg.Partitions = cmp.Or(cfg.Partitions, DefaultPartitions)
	cfg.MinSessionTimeout = cmp.Or(cfg.MinSessionTimeout, DefaultMinSessionTimeout)
	c, err := kfake.NewCluster(kfake.NumBrokers(cfg.Brokers), kfake.DefaultNumPartitions(cfg.Partitions),
		kfake.GroupMinSessionTimeout(cfg.MinSessionTimeout))
	if err != nil {
		return nil, fmt.Errorf("kafkatest: start an in-process Kafka cluster: %w", err)
	}
	return &Cluster{Cluster: c}, nil
}

// New starts a cluster with the defaults for the test t, fails t if it cannot, and closes it
// when t ends.
func New(t testing.TB) *Cluster {
	t.Helper()
	c, err := Start(Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// Brokers returns the addresses of the cluster's brokers, host:port.
func (c *Cluster) Brokers() []string { return c.ListenAddrs() }

// URL returns the kafka:// URL of the cluster for broker.Open, with query appended when it is
// not empty ("group=billing&partitions=2").
func (c *Cluster) URL(query string) string { return URLOf(c.Brokers(), query) }

// URLOf returns the kafka:// URL of the seed brokers, with query appended when it is not
// empty: for a test that runs against a real cluster instead.
func URLOf(brokers []string, query string) string {
	u := "kafka://" + strings.Join(brokers, ",") + "/"
	if query != "" {
		u += "?" + query
	}
	return u
}
