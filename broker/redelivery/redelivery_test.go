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

func TestSettle_RunsTheSubscribersFunctionOnceAfterTheAck(t *testing.T) {
	msg := message.NewMessage("1", nil)
	var calls, acks int
	msg.SetContext(redelivery.NewSettleContext(context.Background(), func() {
		calls++
		if redelivery.Acked(msg) {
			acks++
		}
	}))
	msg.Ack()
	redelivery.Settle(msg)
	redelivery.Settle(msg)
	require.Equal(t, 1, calls)
	require.Equal(t, 1, acks)
}

func TestSettle_NackIsToldApartFromAck(t *testing.T) {
	msg := message.NewMessage("1", nil)
	acked := make(chan bool, 2)
	msg.SetContext(redelivery.NewSettleContext(context.Background(), func() { acked <- redelivery.Acked(msg) }))
	msg.Nack()
	redelivery.Settle(msg)
	require.False(t, <-acked)
	require.Empty(t, acked)
}

func TestSettle_MessageWithoutSettleFunctionIsLeftAlone(t *testing.T) {
	msg := message.NewMessage("1", nil)
	msg.Ack()
	redelivery.Settle(msg) // must not panic
	require.True(t, redelivery.Acked(msg))
}

func TestFlush_RunsTheSubscribersFlushEachCall(t *testing.T) {
	msg := message.NewMessage("1", nil)
	var settled, flushed int
	msg.SetContext(redelivery.NewSettleFlushContext(context.Background(), func() { settled++ }, func() { flushed++ }))
	msg.Ack()
	redelivery.Settle(msg)
	redelivery.Flush(msg)
	redelivery.Flush(msg)
	require.Equal(t, 1, settled, "Settle runs once")
	require.Equal(t, 2, flushed, "Flush runs on every call")
}

func TestFlush_MessageWithoutFlushFunctionIsLeftAlone(t *testing.T) {
	plain := message.NewMessage("1", nil)
	redelivery.Flush(plain) // must not panic
	var settled int
	msg := message.NewMessage("2", nil)
	msg.SetContext(redelivery.NewSettleContext(context.Background(), func() { settled++ }))
	msg.Ack()
	redelivery.Flush(msg)
	require.Zero(t, settled, "Flush does not settle")
}

func TestWithDirectSettle(t *testing.T) {
	require.False(t, redelivery.SettlesDirectly(context.Background()))
	require.True(t, redelivery.SettlesDirectly(redelivery.WithDirectSettle(context.Background())))
}
