package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// Two consumers of one Kafka group, four members each (Concurrency 4), the second joining
// while the first has records in flight and the first leaving while the second has: each
// rebalance moves partitions whose records are being applied. With duplicate detection by
// offset, every record has exactly one effect, the positions table holds one row per
// partition, and no record was handed out while the one before it in its partition was still
// in processing.
func TestExactlyOnceByOffset_KafkaRebalancesApplyEachRecordOnce(t *testing.T) {
	const records = 300
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		if d.Name == "sqlite" {
			t.Skip("two routers on one SQLite file take turns at its write lock: the rebalance is shown on the servers")
		}
		f := newFixture(t, d)
		k := newKafkaByOffset(t, f, "partitions=4")
		for i := range records {
			require.NoError(t, k.pub.Publisher().Publish(k.topic, message.NewMessage(fmt.Sprintf("r-%03d", i), []byte("x"))))
		}
		slow := func(ctx context.Context, msg *messagedata.MessageData) error {
			time.Sleep(2 * time.Millisecond) // records stay in flight across the rebalances
			return applyEffect(ctx, msg)
		}
		stopFirst := k.start(k.group, 4, slow)
		testsvc.Eventually(t, 30*time.Second, func() bool { return k.applied() >= records/4 }, "the first consumer applied nothing")
		k.start(k.group, 4, slow) // joins: the group rebalances while the first has records in flight
		testsvc.Eventually(t, 30*time.Second, func() bool { return k.applied() >= records/2 }, "no progress after the second joined")
		stopFirst() // leaves: its partitions move to the second
		testsvc.Eventually(t, 60*time.Second, func() bool { return k.applied() == records }, "not every record was applied")

		var effects, rows int
		require.NoError(t, f.db.Get(&effects, `SELECT COUNT(*) FROM effects`))
		require.Equal(t, records, effects, "each record has exactly one effect")
		require.NoError(t, f.db.Get(&rows, `SELECT COUNT(*) FROM onceflow_positions WHERE handler = 'effects'`))
		require.LessOrEqual(t, rows, 4, "one row per partition")
		require.Zero(t, k.probe.overlapping(), "records handed out while the one before them in their partition was in processing")
	})
}

// A consumer that takes a partition starts after the offset its handler applied last there,
// whatever Kafka has committed: a new consumer group of the same handler is handed out only
// the records the handler has not applied.
func TestExactlyOnceByOffset_KafkaStartsAfterTheAppliedOffset(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		k := newKafkaByOffset(t, f, "partitions=2")
		publish := func(from, to int) {
			for i := from; i < to; i++ {
				require.NoError(t, k.pub.Publisher().Publish(k.topic, message.NewMessage(fmt.Sprintf("r-%02d", i), []byte("x"))))
			}
		}
		publish(0, 10)
		stop := k.start(k.group, 2, applyEffect)
		testsvc.Eventually(t, 20*time.Second, func() bool { return k.applied() == 10 }, "the first group applied not every record")
		stop()
		require.Equal(t, 10, k.probe.handedOut())

		publish(10, 16)
		k.start(testsvc.UniqueName("g"), 2, applyEffect) // no offsets committed in Kafka
		testsvc.Eventually(t, 20*time.Second, func() bool { return k.applied() == 16 }, "the second group applied not every new record")
		var effects int
		require.NoError(t, f.db.Get(&effects, `SELECT COUNT(*) FROM effects`))
		require.Equal(t, 16, effects)
		require.Equal(t, 16, k.probe.handedOut(), "the second group was handed out the records applied before")
	})
}

// A record that is dead-lettered is acked without moving its partition's position: the
// record behind it is applied at its first delivery all the same, not held back as if it
// came too early.
func TestExactlyOnceByOffset_KafkaRecordAfterADeadLetterIsApplied(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		f := newFixture(t, d)
		k := newKafkaByOffset(t, f, "partitions=1")
		for _, id := range []string{"a", "poison", "b"} {
			require.NoError(t, k.pub.Publisher().Publish(k.topic, message.NewMessage(id, []byte("x"))))
		}
		var mu sync.Mutex
		deliveries := map[string]int{}
		k.start(k.group, 1, func(ctx context.Context, msg *messagedata.MessageData) error {
			mu.Lock()
			deliveries[msg.ID]++
			mu.Unlock()
			if msg.ID == "poison" {
				return processor.Permanent(errors.New("cannot apply"))
			}
			return applyEffect(ctx, msg)
		})
		testsvc.Eventually(t, 20*time.Second, func() bool { return k.applied() == 2 }, "the record after the dead letter was not applied")
		var dead []*message.Message
		testsvc.Eventually(t, 20*time.Second, func() bool {
			dead = append(dead, f.broker.Drain(onceflow.DefaultDeadLetterTopic)...)
			return len(dead) == 1
		}, "not dead-lettered")
		require.Equal(t, "poison", dead[0].UUID)
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, map[string]int{"a": 1, "poison": 1, "b": 1}, deliveries)
	})
}

// kafkaByOffset runs routers with one ByOffset handler ("effects") of a topic on an
// in-process Kafka cluster.
type kafkaByOffset struct {
	t            *testing.T
	f            *fixture
	url          string
	group, topic string
	pub          *broker.Broker
	probe        *partitionProbe
}

// newKafkaByOffset returns a cluster whose topics are created with query ("partitions=4").
func newKafkaByOffset(t *testing.T, f *fixture, query string) *kafkaByOffset {
	k := &kafkaByOffset{t: t, f: f, url: kafkatest.URL(t, query), group: testsvc.UniqueName("g"), topic: testsvc.UniqueName("t"),
		probe: &partitionProbe{last: map[int32]*message.Message{}}}
	k.pub = k.open(k.group)
	return k
}

func (k *kafkaByOffset) open(group string) *broker.Broker {
	b, err := broker.Open(context.Background(), k.url, broker.Options{ConsumerGroup: group, AckTimeout: 3 * time.Second, Prefetch: 32})
	require.NoError(k.t, err)
	k.t.Cleanup(func() { _ = b.Close() })
	return b
}

// start runs a router of group with the handler at concurrency, changed by opts, until stop
// or the end of the test.
func (k *kafkaByOffset) start(group string, concurrency int, proc processor.Func, opts ...func(*onceflow.Handler)) (stop func()) {
	t := k.t
	s, err := k.open(group).Subscriber()
	require.NoError(t, err)
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: k.f.broker, PurgeInterval: -1, CloseTimeout: 10 * time.Second})
	require.NoError(t, err)
	h := onceflow.Handler{Name: "effects", Topic: k.topic, DB: k.f.db, Subscriber: &probedSubscriber{Subscriber: s, probe: k.probe},
		QoS: onceflow.ExactlyOnce, Concurrency: concurrency, Dedup: middleware.Dedup{Mode: middleware.DedupByOffset}, Processor: proc,
		GroupCommit: onceflow.GroupCommitConfig{Disabled: true}} // a partition's records one at a time; opts may turn group commit on
	for _, o := range opts {
		o(&h)
	}
	require.NoError(t, r.AddHandler(h))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	var once sync.Once
	var runErr error
	stop = func() {
		once.Do(func() { cancel(); runErr = <-done })
		require.NoError(t, runErr)
	}
	t.Cleanup(stop)
	return stop
}

// applied returns how many records have an effect.
func (k *kafkaByOffset) applied() int {
	var n int
	require.NoError(k.t, k.f.db.Get(&n, `SELECT COUNT(DISTINCT message_id) FROM effects`))
	return n
}

// partitionProbe watches the messages of a topic's subscriptions as they are handed out:
// overlaps counts those handed out while the message before them in their partition was
// neither acked nor nacked, and its delivery not ended.
type partitionProbe struct {
	mu       sync.Mutex
	last     map[int32]*message.Message
	overlaps int
	handed   int
}

func (p *partitionProbe) overlapping() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.overlaps
}

// handedOut returns how many messages were handed out.
func (p *partitionProbe) handedOut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.handed
}

func (p *partitionProbe) see(msg *message.Message) {
	pos, ok, err := messagedata.PositionOf(&messagedata.MessageData{Headers: msg.Metadata})
	if err != nil || !ok {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.handed++
	if prev := p.last[pos.Partition]; prev != nil {
		select {
		case <-prev.Acked():
		case <-prev.Nacked():
		case <-prev.Context().Done():
		default:
			p.overlaps++
		}
	}
	p.last[pos.Partition] = msg
}

// probedSubscriber shows its probe every message it hands out.
type probedSubscriber struct {
	message.Subscriber
	probe *partitionProbe
}

func (s *probedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range in {
			s.probe.see(msg)
			out <- msg
		}
	}()
	return out, nil
}
