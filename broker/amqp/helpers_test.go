package amqp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/tcpproxy"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// group is the consumer group of the tests.
const group = "g"

// within bounds every wait for a message.
const within = 20 * time.Second

// queueTypes are the queue types every behaviour test runs on.
var queueTypes = []amqp.QueueType{amqp.Classic, amqp.Quorum}

// forEachQueueType runs test as a parallel subtest on a classic and on a quorum queue with a
// consumer that settles directly (redelivery.WithDirectSettle, as the router does), and on the
// classic queue also with one that does not, whose acks and nacks the subscription watches
// for. The two ways of learning of a settlement lead to the same session code, whatever the
// queue type, so the second runs on one.
func forEachQueueType(t *testing.T, test func(t *testing.T, f *fixture)) {
	for i, qt := range queueTypes {
		forEachMode(t, string(qt)+"-", i == 0, func(t *testing.T, direct bool) {
			f := setup(t, amqp.Queue{Type: qt})
			f.direct = direct
			test(t, f)
		})
	}
}

// The settling helpers every test of the package uses: testsvc's.
var (
	forEachMode = testsvc.ForEachSettleMode
	ack         = testsvc.Ack
	nack        = testsvc.Nack
	nackAfter   = testsvc.NackAfter
)

// fixture is one test's RabbitMQ, topic, topology and publisher.
type fixture struct {
	t        testing.TB
	url      string
	topic    string
	topology amqp.Topology
	pub      message.Publisher
	conn     *amqp091.Connection // for looking at the queue
	// direct makes the fixture's subscriptions settle directly (redelivery.WithDirectSettle).
	direct bool
}

func setup(t testing.TB, q amqp.Queue) *fixture {
	t.Helper()
	f := &fixture{
		t:        t,
		url:      testsvc.AMQPURL(t),
		topic:    testsvc.UniqueName("t"),
		topology: amqp.Topology{ConsumerGroup: group, Queue: q},
	}
	t.Cleanup(func() { testsvc.RemoveTopics(t, f.url, []string{group}, f.topic) })
	pub, err := amqp.NewPublisher(f.url, f.topology, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	f.pub = pub
	conn, err := amqp091.Dial(f.url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	f.conn = conn
	return f
}

// config returns the Config of a Subscriber of the fixture's topology on url (the fixture's
// when empty), with prefetch.
func (f *fixture) config(prefetch int) amqp.Config {
	return amqp.Config{URL: f.url, Topology: f.topology, Prefetch: prefetch}
}

// subscriber returns a new Subscriber with cfg, closed when the test ends.
func (f *fixture) subscriber(cfg amqp.Config) *amqp.Subscriber {
	f.t.Helper()
	s, err := amqp.NewSubscriber(cfg)
	require.NoError(f.t, err)
	f.t.Cleanup(func() { _ = s.Close() })
	return s
}

// context returns the context to subscribe with: one that promises redelivery.Settle when the
// fixture settles directly.
func (f *fixture) context() context.Context {
	if f.direct {
		return redelivery.WithDirectSettle(context.Background())
	}
	return context.Background()
}

// subscribe subscribes s to the fixture's topic.
func (f *fixture) subscribe(s *amqp.Subscriber) <-chan *message.Message {
	f.t.Helper()
	msgs, err := s.Subscribe(f.context(), f.topic)
	require.NoError(f.t, err)
	return msgs
}

// publish publishes n messages with the payloads "<prefix>-0".."<prefix>-(n-1)", which are also
// their UUIDs, and returns the UUIDs.
func (f *fixture) publish(prefix string, n int) []string {
	f.t.Helper()
	ids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range n {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
		msgs[i] = message.NewMessage(ids[i], []byte(ids[i]))
	}
	require.NoError(f.t, f.pub.Publish(f.topic, msgs...))
	return ids
}

// queue returns the group queue's ready messages and consumers, as RabbitMQ counts them.
func (f *fixture) queue() (ready, consumers int) {
	f.t.Helper()
	ch, err := f.conn.Channel()
	require.NoError(f.t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(f.topology.QueueName(f.topic), true, false, false, false, nil)
	require.NoError(f.t, err)
	return q.Messages, q.Consumers
}

// eventuallyReady waits until the group's queue has n ready messages.
func (f *fixture) eventuallyReady(n int) {
	f.t.Helper()
	deadline := time.Now().Add(within)
	for {
		got, _ := f.queue()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("after %s: queue %s has %d ready messages, want %d", within, f.topology.QueueName(f.topic), got, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// receive returns the next message of msgs.
func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	return testsvc.Receive(t, ch, within)
}

// uuids returns the UUIDs of msgs.
func uuids(msgs []*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}

// proxy is a loopback TCP proxy in front of RabbitMQ.
type proxy struct {
	p   *tcpproxy.Proxy
	url string // the RabbitMQ URL through the proxy
}

// newProxy starts a proxy in front of the host of rawURL, stopped when the test ends.
func newProxy(t *testing.T, rawURL string) *proxy {
	t.Helper()
	p, through, err := tcpproxy.ForURL(rawURL)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return &proxy{p: p, url: through}
}

// cut closes every connection through the proxy and refuses new ones until restore.
func (p *proxy) cut() { p.p.Cut() }

// restore accepts connections again, on the same address.
func (p *proxy) restore(t *testing.T) {
	t.Helper()
	require.NoError(t, p.p.Restore())
}

// blackhole makes the proxy swallow every byte both ways without closing anything: RabbitMQ
// looks alive and never answers.
func (p *proxy) blackhole() { p.p.Blackhole() }
