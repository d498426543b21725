package nats_test

import (
	"context"
	"testing"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// pushConsumer creates the group's durable consumer on the fixture's topic as onceflow's
// watermill-nats subscriber did (a push consumer with a deliver group), and returns a
// connection to the server and the consumer's deliver subject.
func (f *fixture) pushConsumer() (*nats.Conn, string) {
	f.t.Helper()
	nc, err := nats.Connect(f.url)
	require.NoError(f.t, err)
	f.t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	require.NoError(f.t, err)
	stream, err := js.StreamNameBySubject(f.topic)
	require.NoError(f.t, err)
	name := natsbroker.ConsumerName(f.group, f.topic)
	deliver := nats.NewInbox()
	_, err = js.AddConsumer(stream, &nats.ConsumerConfig{
		Durable:        name,
		DeliverSubject: deliver,
		DeliverGroup:   name,
		DeliverPolicy:  nats.DeliverAllPolicy,
		AckPolicy:      nats.AckExplicitPolicy,
		AckWait:        30 * time.Second,
		MaxDeliver:     -1,
		MaxAckPending:  1000,
		FilterSubject:  f.topic,
	})
	require.NoError(f.t, err)
	return nc, deliver
}

// consumerInfo returns the group's consumer on the fixture's topic as the server has it.
func (f *fixture) consumerInfo() *jetstream.ConsumerInfo {
	f.t.Helper()
	nc, err := nats.Connect(f.url)
	require.NoError(f.t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(f.t, err)
	c, err := js.Consumer(context.Background(), natsbroker.StreamName(f.topic), natsbroker.ConsumerName(f.group, f.topic))
	require.NoError(f.t, err)
	return c.CachedInfo()
}

func TestSubscriber_ReplacesTheGroupsPushConsumerAfterItsAckFloor(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		ids := f.publish(0, 5)
		nc, deliver := f.pushConsumer()

		// The earlier subscriber acknowledged the first two messages, held the third, and went
		// away.
		old, err := nc.QueueSubscribeSync(deliver, natsbroker.ConsumerName(f.group, f.topic))
		require.NoError(t, err)
		for i := range 3 {
			m, err := old.NextMsg(within)
			require.NoError(t, err)
			require.Equal(t, ids[i], m.Header.Get(wnats.WatermillUUIDHdr))
			if i < 2 {
				require.NoError(t, m.AckSync())
			}
		}
		require.NoError(t, old.Unsubscribe())
		require.Equal(t, uint64(2), f.consumerInfo().AckFloor.Stream)

		ch := f.subscribe(f.subscriber(natsbroker.Config{}))
		for _, id := range ids[2:] {
			m := testsvc.Receive(t, ch, within)
			require.Equal(t, id, m.UUID, "the pull consumer starts after the push consumer's ack floor")
			require.Equal(t, 1, testsvc.Info(t, m).Count, "delivery counts start again")
			m.Ack()
		}
		testsvc.RequireOpenAndNothing(t, ch, 300*time.Millisecond)
		info := f.consumerInfo()
		require.Positive(t, info.Config.MaxWaiting, "a pull consumer")
		require.Equal(t, jetstream.DeliverByStartSequencePolicy, info.Config.DeliverPolicy)
		require.Equal(t, uint64(3), info.Config.OptStartSeq)

		// The replacement is done once: the next subscriber takes the pull consumer as it is.
		next := f.subscribe(f.subscriber(natsbroker.Config{}))
		more := f.publish(5, 6)
		m := testsvc.Receive(t, mergeOf(ch, next), within)
		require.Equal(t, more[0], m.UUID)
		m.Ack()
		require.Equal(t, uint64(3), f.consumerInfo().Config.OptStartSeq)
	})
}

func TestSubscriber_RefusesToReplaceAPushConsumerThatIsInUse(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.publish(0, 1)
	nc, deliver := f.pushConsumer()
	_, err := nc.QueueSubscribeSync(deliver, natsbroker.ConsumerName(f.group, f.topic))
	require.NoError(t, err)
	require.NoError(t, nc.Flush())

	s := f.subscriber(natsbroker.Config{})
	_, err = s.Subscribe(context.Background(), f.topic)
	require.ErrorContains(t, err, "is a push consumer that a subscriber still receives from")
	require.ErrorContains(t, err, "stop those consumers")
	require.Zero(t, f.consumerInfo().Config.MaxWaiting, "the push consumer is left alone")
}
