package kafka_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	kafkabroker "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// within bounds every wait for something that must happen.
const within = 20 * time.Second

// fast are client options that make group changes quick in tests.
var fast = []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(200 * time.Millisecond)}

// fixture is one test's cluster, topic (created with partitions partitions) and group.
type fixture struct {
	t       *testing.T
	brokers []string
	topic   string
	group   string
	admin   *kadm.Client
	pub     *kafkabroker.Publisher
}

func setup(t *testing.T, partitions int32) *fixture {
	t.Helper()
	brokers := kafkatest.Brokers(t)
	f := &fixture{t: t, brokers: brokers, topic: testsvc.UniqueName("t"), group: testsvc.UniqueName("g")}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	f.admin = kadm.NewClient(cl)
	_, err = f.admin.CreateTopic(context.Background(), partitions, -1, nil, f.topic)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = f.admin.DeleteTopics(context.Background(), f.topic) })
	f.pub, err = kafkabroker.NewPublisher(kafkabroker.PublisherConfig{Brokers: brokers})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, f.pub.Close()) })
	return f
}

// subscriber returns a Subscriber of the fixture's group, closed when the test ends.
func (f *fixture) subscriber(cfg kafkabroker.Config) *kafkabroker.Subscriber {
	f.t.Helper()
	cfg.Brokers = f.brokers
	if cfg.ConsumerGroup == "" {
		cfg.ConsumerGroup = f.group
	}
	cfg.ClientOptions = append(cfg.ClientOptions, fast...)
	s, err := kafkabroker.NewSubscriber(cfg)
	require.NoError(f.t, err)
	f.t.Cleanup(func() { _ = s.Close() })
	return s
}

// subscribe subscribes s to the fixture's topic until the test ends.
func (f *fixture) subscribe(s *kafkabroker.Subscriber) <-chan *message.Message {
	f.t.Helper()
	ch, err := s.Subscribe(context.Background(), f.topic)
	require.NoError(f.t, err)
	return ch
}

// message returns the i-th test message of the fixture.
func (f *fixture) message(i int) *message.Message {
	m := message.NewMessage(fmt.Sprintf("%s-%04d", f.topic, i), []byte(fmt.Sprintf("payload %d \x00\xff", i)))
	m.Metadata.Set("k", fmt.Sprintf("v%d", i))
	return m
}

// publish publishes the messages from..to-1 of the fixture and returns their UUIDs.
func (f *fixture) publish(from, to int) []string {
	f.t.Helper()
	var ids []string
	var msgs []*message.Message
	for i := from; i < to; i++ {
		m := f.message(i)
		msgs = append(msgs, m)
		ids = append(ids, m.UUID)
	}
	require.NoError(f.t, f.pub.Publish(f.topic, msgs...))
	return ids
}

// settled waits until the fixture's group is stable with members members, each assigned
// partitions of the topic.
func (f *fixture) settled(members int) {
	f.t.Helper()
	testsvc.Eventually(f.t, within, func() bool {
		return kafkatest.Settled(context.Background(), f.admin, f.group, members)
	}, "group %s did not settle with %d members", f.group, members)
}

// committed returns the group's committed offsets of the topic, by partition.
func (f *fixture) committed() map[int32]int64 {
	f.t.Helper()
	resp, err := f.admin.FetchOffsets(context.Background(), f.group)
	require.NoError(f.t, err)
	out := map[int32]int64{}
	for p, o := range resp[f.topic] {
		out[p] = o.At
	}
	return out
}

// committedTotal is the sum of the committed offsets of the topic: how many records of a
// topic written from empty are below the marks.
func (f *fixture) committedTotal() int64 {
	var n int64
	for _, o := range f.committed() {
		n += o
	}
	return n
}
