package amqp_test

import (
	"context"
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// childEnv carries the Config of TestKilledConsumer_Child, as JSON.
const childEnv = "ONCEFLOW_AMQP_TEST_CHILD"

type childConfig struct {
	URL   string
	Topic string
	Queue amqp.Queue
	// Direct: subscribe as a consumer that settles directly.
	Direct bool
}

// TestKilledConsumer_Child is the consumer process of
// TestSubscriber_DeliveryCountSurvivesAKilledConsumer: it takes one message, says so on stdout,
// and waits to be killed.
func TestKilledConsumer_Child(t *testing.T) {
	raw := os.Getenv(childEnv)
	if raw == "" {
		t.Skip("run by TestSubscriber_DeliveryCountSurvivesAKilledConsumer")
	}
	var c childConfig
	require.NoError(t, json.Unmarshal([]byte(raw), &c))
	s, err := amqp.NewSubscriber(amqp.Config{URL: c.URL, Topology: amqp.Topology{ConsumerGroup: group, Queue: c.Queue}})
	require.NoError(t, err)
	ctx := context.Background()
	if c.Direct {
		ctx = redelivery.WithDirectSettle(ctx)
	}
	msgs, err := s.Subscribe(ctx, c.Topic)
	require.NoError(t, err)
	m := receive(t, msgs)
	testsvc.SayHolding(t, m)
	select {}
}

// A consumer process killed with SIGKILL while it holds a message leaves it to the next
// consumer as soon as RabbitMQ sees the connection close, and a quorum queue has counted the
// delivery: the count that bounds a crash loop survives the crash.
func TestSubscriber_DeliveryCountSurvivesAKilledConsumer(t *testing.T) {
	t.Parallel()
	forEachQueueType(t, func(t *testing.T, f *fixture) {
		id := f.publish("m", 1)[0]
		env, err := json.Marshal(childConfig{URL: f.url, Topic: f.topic, Queue: f.topology.Queue, Direct: f.direct})
		require.NoError(t, err)
		child := testsvc.StartChild(t, childEnv+"="+string(env))
		first := "0"
		if f.topology.Queue.Type == amqp.Quorum {
			first = "1"
		}
		require.Equal(t, id+" "+first, child.Expect(t, "HOLDING", within))

		msgs := f.subscribe(f.subscriber(f.config(10)))
		testsvc.RequireNothing(t, msgs, 300*time.Millisecond) // the child holds it

		child.Kill()
		m := receive(t, msgs)
		require.Equal(t, id, m.UUID)
		requireAgain(t, f.topology.Queue.Type, m)
		ack(m)
	})
}
