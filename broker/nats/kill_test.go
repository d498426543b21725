package nats_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// Environment of the consumer process of TestSubscriber_DeliveryCountSurvivesAConsumerKilledMidDelivery.
const (
	childURLEnv   = "ONCEFLOW_NATS_TEST_CHILD_URL"
	childTopicEnv = "ONCEFLOW_NATS_TEST_CHILD_TOPIC"
	childGroupEnv = "ONCEFLOW_NATS_TEST_CHILD_GROUP"
	// childDirectEnv, when set, makes the child subscribe as a consumer that settles each
	// message itself (redelivery.WithDirectSettle).
	childDirectEnv = "ONCEFLOW_NATS_TEST_CHILD_DIRECT"
)

// killAckWait is the AckWait of the killed consumer and of the one after it.
const killAckWait = 2 * time.Second

// TestKilledConsumer_Child is the consumer process of
// TestSubscriber_DeliveryCountSurvivesAConsumerKilledMidDelivery: it takes one message, says
// so on stdout with its delivery count, and waits to be killed.
func TestKilledConsumer_Child(t *testing.T) {
	rawURL := os.Getenv(childURLEnv)
	if rawURL == "" {
		t.Skip("run by TestSubscriber_DeliveryCountSurvivesAConsumerKilledMidDelivery")
	}
	s, err := natsbroker.NewSubscriber(natsbroker.Config{URL: rawURL, ConsumerGroup: os.Getenv(childGroupEnv), AckWait: killAckWait})
	require.NoError(t, err)
	ctx := context.Background()
	if os.Getenv(childDirectEnv) != "" {
		ctx = redelivery.WithDirectSettle(ctx)
	}
	ch, err := s.Subscribe(ctx, os.Getenv(childTopicEnv))
	require.NoError(t, err)
	m := testsvc.Receive(t, ch, within)
	testsvc.SayHolding(t, m)
	select {}
}

// The delivery count is the server's: a consumer process killed (SIGKILL) in the middle of a
// delivery leaves the message to the next consumer after AckWait, counted, so that a message
// that crashes its consumers reaches the delivery limit.
func TestSubscriber_DeliveryCountSurvivesAConsumerKilledMidDelivery(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		id := f.publish(0, 1)[0]
		for want := 1; want <= 2; want++ {
			got := holdInAChildAndKillIt(t, f)
			require.Equal(t, fmt.Sprintf("%s %d", id, want), got, "message and delivery count of killed consumer %d", want)
		}
		ch := f.subscribe(f.subscriber(natsbroker.Config{AckWait: killAckWait}))
		m := testsvc.Receive(t, ch, within)
		require.Equal(t, id, m.UUID)
		require.Equal(t, 3, testsvc.Info(t, m).Count)
		m.Ack()
	})
}

// holdInAChildAndKillIt starts a consumer process of the fixture's group, waits for it to hold
// a message, kills it and returns what it said it holds: the UUID and the delivery count.
func holdInAChildAndKillIt(t *testing.T, f *fixture) string {
	t.Helper()
	env := []string{childURLEnv + "=" + f.url, childTopicEnv + "=" + f.topic, childGroupEnv + "=" + f.group}
	if f.direct {
		env = append(env, childDirectEnv+"=1")
	}
	child := testsvc.StartChild(t, env...)
	defer child.Kill()
	return child.Expect(t, "HOLDING", within)
}
