package delivery_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceflow/onceflow/internal/delivery"
)

type parentKey struct{}

func TestStart_CarriesItsStateAndIsItsParentOtherwise(t *testing.T) {
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), parentKey{}, "v"))
	received := time.Unix(100, 0)
	ctx, st := delivery.Start(parent, "h", received)

	require.Same(t, st, delivery.From(ctx))
	require.Equal(t, delivery.State{Handler: "h", Received: received}, *st)
	require.Equal(t, "v", ctx.Value(parentKey{}))
	child, stop := context.WithCancel(context.WithValue(ctx, parentKey{}, "child"))
	defer stop()
	require.Same(t, st, delivery.From(child), "a context derived from it carries the same State")

	delivery.MarkCommitted(child, received.Add(time.Second))
	require.Equal(t, received.Add(time.Second), st.CommittedAt)

	require.NoError(t, ctx.Err())
	cancel()
	<-child.Done()
	require.ErrorIs(t, ctx.Err(), context.Canceled)
	require.ErrorIs(t, child.Err(), context.Canceled)
	require.Nil(t, delivery.From(parent))
}

var sink context.Context

func TestStart_AllocatesOnce(t *testing.T) {
	parent := context.Background()
	allocs := testing.AllocsPerRun(100, func() {
		sink, _ = delivery.Start(parent, "h", time.Time{}) // kept, as a delivery's context is
	})
	require.Equal(t, 1.0, allocs)
}

// The router's delivery takes the consumer span, once; a delivery whose span ends in the chain,
// or none, does not.
func TestHandOverSpan_OnlyToTheRouterOnce(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	_, span := tp.Tracer("t").Start(context.Background(), "process t")
	defer span.End()

	routed := &delivery.State{}
	require.True(t, delivery.HandOverSpan(routed, span))
	require.False(t, delivery.HandOverSpan(routed, span), "one consumer span per delivery")
	require.False(t, delivery.HandOverSpan(&delivery.State{EndSpanInChain: true}, span))
	require.False(t, delivery.HandOverSpan(nil, span))
}
