package delivery_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/txctx"
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

// StartWith gives the caller's state of the delivery with its context and State, in the one
// allocation, and the context carries the State as Start's does, transaction included.
func TestStartWith_AllocatesOnceForTheCallersStateToo(t *testing.T) {
	type extra struct{ n int }
	ctx, st, e := delivery.StartWith[extra](context.Background(), "h", time.Time{})
	require.Same(t, st, delivery.From(ctx))
	require.Equal(t, "h", st.Handler)
	require.Zero(t, *e)
	txCtx, txSt := delivery.WithTx(ctx, "tx")
	require.Same(t, st, txSt)
	require.Equal(t, "tx", txctx.Tx(txCtx))
	txSt.EndTx()
	parent := context.Background()
	allocs := testing.AllocsPerRun(100, func() {
		sink, _, e = delivery.StartWith[extra](parent, "h", time.Time{}) // kept, as the router keeps them
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

// A delivery's context carries the attempt's transaction in its State until EndTx, with no
// allocation, and every context derived from it sees it as through txctx.WithTx.
func TestWithTx_ADeliveryCarriesItInItsStateUntilEndTx(t *testing.T) {
	ctx, _ := delivery.Start(context.Background(), "h", time.Time{})
	child, stop := context.WithCancel(ctx)
	defer stop()

	txCtx, st := delivery.WithTx(child, "tx1")
	require.Same(t, child, txCtx, "no context of its own")
	require.NotNil(t, st)
	require.Equal(t, "tx1", txctx.Tx(context.WithValue(txCtx, parentKey{}, "v")))

	nested, inner := delivery.WithTx(txCtx, "tx2")
	require.Nil(t, inner, "a transaction inside another takes a context of its own")
	require.Equal(t, "tx2", txctx.Tx(nested))
	require.Equal(t, "tx1", txctx.Tx(txCtx))

	st.EndTx()
	require.Nil(t, txctx.Tx(txCtx))
	require.Nil(t, txctx.Tx(ctx))

	allocs := testing.AllocsPerRun(100, func() {
		_, st := delivery.WithTx(child, "tx1")
		st.EndTx()
	})
	require.Zero(t, allocs)
}

// Outside a delivery, WithTx is txctx.WithTx.
func TestWithTx_ElsewhereAContextOfItsOwn(t *testing.T) {
	ctx := context.Background()
	txCtx, st := delivery.WithTx(ctx, "tx")
	require.Nil(t, st)
	require.Equal(t, "tx", txctx.Tx(txCtx))
	require.Nil(t, txctx.Tx(ctx))
	st.EndTx() // does nothing
}
