package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Topics creates the Kafka topics that a publisher or a subscriber finds missing, once per
// topic and process. It is safe for concurrent use.
type Topics struct {
	admin             *kadm.Client
	partitions        int32
	replicationFactor int16

	mu    sync.Mutex
	known map[string]bool
}

// NewTopics returns a Topics that creates topics through cl (which it does not close) with
// partitions partitions and replicationFactor replicas; -1 for either selects the brokers'
// default (num.partitions, default.replication.factor).
func NewTopics(cl *kgo.Client, partitions int32, replicationFactor int16) *Topics {
	return &Topics{admin: kadm.NewClient(cl), partitions: partitions, replicationFactor: replicationFactor, known: map[string]bool{}}
}

// Ensure creates topic when it does not exist. A topic that exists, whatever its partition
// count, is left alone.
func (t *Topics) Ensure(ctx context.Context, topic string) error {
	t.mu.Lock()
	known := t.known[topic]
	t.mu.Unlock()
	if known {
		return nil
	}
	resp, err := t.admin.CreateTopic(ctx, t.partitions, t.replicationFactor, nil, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
		return fmt.Errorf("kafka: create topic %q: %w", topic, err)
	}
	t.mu.Lock()
	t.known[topic] = true
	t.mu.Unlock()
	return nil
}
