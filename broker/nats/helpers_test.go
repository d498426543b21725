package nats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// within bounds every wait for something that must happen.
const within = 20 * time.Second

// fixture is one test's server, topic and consumer group, and the publisher of package broker
// (watermill-nats's, as in production).
type fixture struct {
	t     *testing.T
	url   string
	topic string
	group string
	pub   message.Publisher
	// direct makes the fixture's subscriptions those of a consumer that settles each message
	// itself (redelivery.WithDirectSettle), through settler.
	direct  bool
	settler testsvc.Settler
}

// inBothModes runs test twice, in parallel, each with a fixture of its own: as a consumer that
// only acks and nacks (the subscriber watches every message), and as one that also tells the
// subscriber of each ack and nack itself (redelivery.Settle), as onceflow's router does.
func inBothModes(t *testing.T, test func(t *testing.T, f *fixture)) {
	t.Helper()
	testsvc.ForEachSettleMode(t, "", true, func(t *testing.T, direct bool) {
		f := setup(t)
		f.direct = direct
		test(t, f)
	})
}

// setup returns a fixture with a topic and a group of the test's own; the topic's stream (and
// the group's consumer) is removed when the test ends.
func setup(t *testing.T) *fixture {
	t.Helper()
	url := testsvc.NATSURL(t)
	f := &fixture{t: t, url: url, topic: testsvc.UniqueName("t"), group: testsvc.UniqueName("g")}
	t.Cleanup(func() { testsvc.RemoveTopics(t, url, nil, f.topic) })
	b, err := broker.Open(context.Background(), url, broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	f.pub = b.Publisher()
	return f
}

// config returns cfg with the fixture's server and group.
func (f *fixture) config(cfg natsbroker.Config) natsbroker.Config {
	if cfg.URL == "" {
		cfg.URL = f.url
	}
	if cfg.ConsumerGroup == "" {
		cfg.ConsumerGroup = f.group
	}
	return cfg
}

// subscriber returns a new Subscriber of the fixture's group, closed when the test ends.
func (f *fixture) subscriber(cfg natsbroker.Config) *natsbroker.Subscriber {
	f.t.Helper()
	s, err := natsbroker.NewSubscriber(f.config(cfg))
	require.NoError(f.t, err)
	f.t.Cleanup(func() { _ = s.Close() })
	return s
}

// subscribe subscribes s to the fixture's topic until the test ends.
func (f *fixture) subscribe(s *natsbroker.Subscriber) <-chan *message.Message {
	f.t.Helper()
	ch, err := f.subscribeWith(context.Background(), s)
	require.NoError(f.t, err)
	return ch
}

// subscribeWith subscribes s to the fixture's topic with ctx, in the fixture's mode.
func (f *fixture) subscribeWith(ctx context.Context, s *natsbroker.Subscriber) (<-chan *message.Message, error) {
	if !f.direct {
		return s.Subscribe(ctx, f.topic)
	}
	ch, err := s.Subscribe(redelivery.WithDirectSettle(ctx), f.topic)
	if err != nil {
		return nil, err
	}
	return f.settler.Settling(f.t, ch), nil
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
	for i := from; i < to; i++ {
		m := f.message(i)
		require.NoError(f.t, f.pub.Publish(f.topic, m))
		ids = append(ids, m.UUID)
	}
	return ids
}

// mergeOf returns a channel that gets the messages of a and b.
func mergeOf(a, b <-chan *message.Message) <-chan *message.Message {
	out := make(chan *message.Message)
	for _, ch := range []<-chan *message.Message{a, b} {
		go func() {
			for m := range ch {
				out <- m
			}
		}()
	}
	return out
}
