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
	msg.SetContext(redelivery.NewDeliveryContext(context.Background(), redelivery.Info{}, func() {
		calls++
		if redelivery.Acked(msg) {
			acks++
		}
	}, nil))
	msg.Ack()
	redelivery.Settle(msg)
	redelivery.Settle(msg)
	require.Equal(t, 1, calls)
	require.Equal(t, 1, acks)
}

func TestSettle_NackIsToldApartFromAck(t *testing.T) {
	msg := message.NewMessage("1", nil)
	acked := make(chan bool, 2)
	msg.SetContext(redelivery.NewDeliveryContext(context.Background(), redelivery.Info{}, func() { acked <- redelivery.Acked(msg) }, nil))
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
	msg.SetContext(redelivery.NewDeliveryContext(context.Background(), redelivery.Info{}, func() { settled++ }, func() { flushed++ }))
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
	msg.SetContext(redelivery.NewDeliveryContext(context.Background(), redelivery.Info{}, func() { settled++ }, nil))
	msg.Ack()
	redelivery.Flush(msg)
	require.Zero(t, settled, "Flush does not settle")
}

func TestWithDirectSettle(t *testing.T) {
	require.False(t, redelivery.SettlesDirectly(context.Background()))
	require.True(t, redelivery.SettlesDirectly(redelivery.WithDirectSettle(context.Background())))
}

// A delivery context carries the Info, settles once, flushes on every call, keeps the values
// and the cancellation of its parent, and NackAfter records its delay in it.
func TestNewDeliveryContext_CarriesInfoSettlesOnceAndFlushes(t *testing.T) {
	type parentKey struct{}
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), parentKey{}, "p"))
	info := redelivery.Info{Count: 3, DelaysNacks: true}
	var settled, flushed int
	ctx := redelivery.NewDeliveryContext(parent, info, func() { settled++ }, func() { flushed++ })

	got, ok := redelivery.FromContext(ctx)
	require.True(t, ok)
	require.Equal(t, info, got)
	require.Equal(t, "p", ctx.Value(parentKey{}))

	nackSettleAndFlushTwice(t, ctx)
	require.Equal(t, 1, settled, "Settle runs once")
	require.Equal(t, 2, flushed, "Flush runs on every call")

	child, stop := context.WithCancel(ctx)
	defer stop()
	cancel()
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a context derived from the delivery context did not end with its parent")
	}
}

// One delivery context, its Info and its settle and flush functions, is one allocation.
func TestNewDeliveryContext_AllocatesOnce(t *testing.T) {
	parent := context.Background()
	settled, flush := func() {}, func() {}
	var sink context.Context
	allocs := testing.AllocsPerRun(100, func() {
		sink = redelivery.NewDeliveryContext(parent, redelivery.Info{Count: 1}, settled, flush)
	})
	_ = sink
	require.Equal(t, 1.0, allocs)
}

// nackSettleAndFlushTwice nacks a message whose context is ctx with a delay of a minute, which
// it must record, then settles it twice and flushes it twice.
func nackSettleAndFlushTwice(t *testing.T, ctx context.Context) {
	t.Helper()
	msg := message.NewMessage("1", nil)
	msg.SetContext(ctx)
	require.True(t, redelivery.NackAfter(msg, time.Minute))
	delay, ok := redelivery.RequestedDelay(msg.Context())
	require.True(t, ok)
	require.Equal(t, time.Minute, delay)
	redelivery.Settle(msg)
	redelivery.Settle(msg)
	redelivery.Flush(msg)
	redelivery.Flush(msg)
}

// valuesContext is a subscriber's own delivery context that keeps the Values in itself.
type valuesContext struct {
	context.Context
	v                redelivery.Values
	settled, flushed int
}

func (c *valuesContext) Value(k any) any {
	if v, ok := c.v.Value(k); ok {
		return v
	}
	return c.Context.Value(k)
}

func (c *valuesContext) Settled() { c.settled++ }
func (c *valuesContext) Flush()   { c.flushed++ }

// Values kept in a context of the subscriber's own do what NewDeliveryContext's do, with the
// Settler's methods for the functions; without a Settler, Settle and Flush leave the message
// alone; the zero Values carry nothing.
func TestValues_CarryWhatNewDeliveryContextCarries(t *testing.T) {
	info := redelivery.Info{Count: 2, DelaysNacks: true}
	c := &valuesContext{Context: context.Background()}
	c.v.Init(info, c)
	got, ok := redelivery.FromContext(c)
	require.True(t, ok)
	require.Equal(t, info, got)
	nackSettleAndFlushTwice(t, c)
	require.Equal(t, 1, c.settled, "Settle runs once")
	require.Equal(t, 2, c.flushed, "Flush runs on every call")

	watched := &valuesContext{Context: context.Background()}
	watched.v.Init(info, nil)
	msg := message.NewMessage("2", nil)
	msg.SetContext(watched)
	msg.Ack()
	redelivery.Settle(msg)
	redelivery.Flush(msg)
	got, ok = redelivery.FromContext(msg.Context())
	require.True(t, ok)
	require.Equal(t, info, got)
	require.Zero(t, watched.settled+watched.flushed)

	var zero redelivery.Values
	_, ok = zero.Value(struct{}{})
	require.False(t, ok)
	_, ok = redelivery.FromContext(&valuesContext{Context: context.Background()})
	require.False(t, ok, "the zero Values carry no Info")
}

// A subscriber whose prefetch was left to its default takes the consumer's window when it is
// larger, within the subscriber's bound.
func TestWindowFrom_LargerWindowOfTheConsumerReplacesTheDefault(t *testing.T) {
	bg := context.Background()
	require.Equal(t, 10, redelivery.WindowFrom(bg, 10, 0), "no window asked")
	require.Equal(t, 10, redelivery.WindowFrom(redelivery.WithWindow(bg, 4), 10, 0), "smaller than the default")
	require.Equal(t, 128, redelivery.WindowFrom(redelivery.WithWindow(bg, 128), 10, 0))
	require.Equal(t, 100, redelivery.WindowFrom(redelivery.WithWindow(bg, 128), 10, 100), "bounded")
	require.Equal(t, 10, redelivery.WindowFrom(redelivery.WithWindow(bg, 0), 10, 0), "0 asks for nothing")
}

// A delivery context without functions gives Settle and Flush nothing to run.
func TestNewDeliveryContext_WithoutFunctionsSettlesAndFlushesNothing(t *testing.T) {
	msg := message.NewMessage("m", nil)
	msg.SetContext(redelivery.NewDeliveryContext(context.Background(), redelivery.Info{Count: 1}, nil, nil))
	msg.Ack()
	require.NotPanics(t, func() {
		redelivery.Settle(msg)
		redelivery.Flush(msg)
	})
}
