package redelivery_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
)

func delivered(info redelivery.Info) *message.Message {
	msg := message.NewMessage("m1", nil)
	msg.SetContext(redelivery.NewContext(context.Background(), info))
	return msg
}

func TestNackAfter_DelayingSubscriberGetsTheDelayAndTheNack(t *testing.T) {
	msg := delivered(redelivery.Info{Count: 3, DelaysNacks: true})
	_, requested := redelivery.RequestedDelay(msg.Context())
	require.False(t, requested, "no delay before NackAfter")

	require.True(t, redelivery.NackAfter(msg, 5*time.Second))
	select {
	case <-msg.Nacked():
	default:
		t.Fatal("NackAfter did not nack the message")
	}
	d, requested := redelivery.RequestedDelay(msg.Context())
	require.True(t, requested)
	require.Equal(t, 5*time.Second, d)
}

func TestNackAfter_ZeroDelayIsARequest(t *testing.T) {
	msg := delivered(redelivery.Info{Count: 1, DelaysNacks: true})
	require.True(t, redelivery.NackAfter(msg, 0))
	d, requested := redelivery.RequestedDelay(msg.Context())
	require.True(t, requested)
	require.Zero(t, d)
}

func TestNackAfter_SubscriberThatCannotDelayIsLeftAlone(t *testing.T) {
	for name, msg := range map[string]*message.Message{
		"no info":         message.NewMessage("m1", nil),
		"cannot delay":    delivered(redelivery.Info{Redelivered: true}),
		"count, no delay": delivered(redelivery.Info{Count: 2}),
	} {
		require.False(t, redelivery.NackAfter(msg, time.Second), name)
		select {
		case <-msg.Nacked():
			t.Fatalf("%s: NackAfter nacked a message whose subscriber cannot delay", name)
		default:
		}
	}
}

func TestFromContext(t *testing.T) {
	_, ok := redelivery.FromContext(context.Background())
	require.False(t, ok)
	info, ok := redelivery.FromContext(delivered(redelivery.Info{Count: 4, DelaysNacks: true}).Context())
	require.True(t, ok)
	require.Equal(t, redelivery.Info{Count: 4, DelaysNacks: true}, info)
}

func TestInfo_First(t *testing.T) {
	require.True(t, redelivery.Info{Count: 1}.First())
	require.False(t, redelivery.Info{Count: 2}.First())
	require.True(t, redelivery.Info{}.First(), "count unknown, not redelivered")
	require.False(t, redelivery.Info{Redelivered: true}.First())
}
