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
	known             sync.Map // the topics known to exist, as keys
}

// NewTopics returns a Topics that creates topics through cl (which it does not close) with
// partitions partitions and replicationFactor replicas; -1 for either selects the brokers'
// default (num.partitions, default.replication.factor).
func NewTopics(cl *kgo.Client, partitions int32, replicationFactor int16) *Topics {
	return &Topics{admin: kadm.NewClient(cl), partitions: partitions, replicationFactor: replicationFactor}
}

// Ensure creates topic when it does not exist. A topic that exists, whatever its partition
// count, is left alone.
func (t *Topics) Ensure(ctx context.Context, topic string) error {
	if _, known := t.known.Load(topic); known {
		return nil
	}
	resp, err := t.admin.CreateTopic(ctx, t.partitions, t.replicationFactor, nil, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
		return fmt.Errorf("kafka: create topic %q: %w", topic, err)
	}
	t.known.Store(topic, true)
	return nil
}
