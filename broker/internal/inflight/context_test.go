package inflight

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
)

type baseKey struct{}

// newDeliveryContext returns the context of a delivery whose subscription's base carries
// baseKey, with Info count 2.
func newDeliveryContext() *deliveryContext[int] {
	d := &Delivery[int]{}
	d.ctx.base, d.ctx.d = context.WithValue(context.Background(), baseKey{}, "base"), d
	d.ctx.vals.Init(redelivery.Info{Count: 2, DelaysNacks: true}, nil)
	return &d.ctx
}

// closed reports whether ch is closed, without waiting.
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func TestDeliveryContext_CarriesTheBaseValuesAndTheInfo(t *testing.T) {
	c := newDeliveryContext()
	require.Equal(t, "base", c.Value(baseKey{}))
	info, ok := redelivery.FromContext(c)
	require.True(t, ok)
	require.Equal(t, redelivery.Info{Count: 2, DelaysNacks: true}, info)
	_, hasDeadline := c.Deadline()
	require.False(t, hasDeadline)
	require.NoError(t, c.Err())
	require.NoError(t, context.Cause(c))
	c.Done() // asking for Done changes none of it
	require.Equal(t, "base", c.Value(baseKey{}))
	require.NoError(t, c.Err())
	require.NoError(t, context.Cause(c))
}

func TestDeliveryContext_EndsAsAContextOfWithCancelCause(t *testing.T) {
	errLost := errors.New("lost")
	for _, tc := range []struct {
		name       string
		cause      error
		want       error
		doneBefore bool
	}{
		{"settled", nil, context.Canceled, false},
		{"settled, Done asked before", nil, context.Canceled, true},
		{"canceled", context.Canceled, context.Canceled, false},
		{"with a cause", errLost, errLost, false},
		{"with a cause, Done asked before", errLost, errLost, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newDeliveryContext()
			if tc.doneBefore {
				require.False(t, closed(c.Done()))
			}
			c.end(tc.cause)
			c.end(errors.New("a later end changes nothing"))
			require.ErrorIs(t, c.Err(), context.Canceled)
			require.True(t, closed(c.Done()))
			require.Equal(t, tc.want, context.Cause(c))
			require.Equal(t, "base", c.Value(baseKey{}))
		})
	}
}

func TestDeliveryContext_EndsTheContextsDerivedFromIt(t *testing.T) {
	errLost := errors.New("lost")
	c := newDeliveryContext()
	child, cancel := context.WithCancel(c)
	defer cancel()
	ran := make(chan struct{})
	context.AfterFunc(c, func() { close(ran) })
	require.NoError(t, child.Err())
	c.end(errLost)
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the derived context did not end")
	}
	require.Equal(t, errLost, context.Cause(child))
	select {
	case <-ran:
	case <-time.After(5 * time.Second):
		t.Fatal("the AfterFunc did not run")
	}
	// Derived after the end: ended at once.
	late, cancelLate := context.WithCancel(c)
	defer cancelLate()
	require.ErrorIs(t, late.Err(), context.Canceled)
	require.Equal(t, errLost, context.Cause(late))
}

// A context whose Done is closed reports its end in Err (the context contract, on which
// database drivers rely: go-sql-driver/mysql stores ctx.Err() when Done is closed), even to a
// goroutine that Done wakes while end is still running.
func TestDeliveryContext_ErrIsSetOnceDoneIsClosed(t *testing.T) {
	for range 2000 {
		c := newDeliveryContext()
		done := c.Done()
		seen := make(chan error)
		go func() {
			<-done
			seen <- c.Err()
		}()
		c.end(nil)
		require.ErrorIs(t, <-seen, context.Canceled)
	}
}

type subscribeKey struct{}

type missingKey struct{}

// A delivery's context looks up what it does not carry in its Subscribe context, without an
// allocation per lookup, and does not end with that context.
func TestDeliveryContext_LooksUpTheSubscribeContextWithoutAllocating(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.WithValue(context.Background(), subscribeKey{}, "sub"))
	s := New[int](ctx, nil, Options{Prefetch: 1})
	c := s.Emit(Item[int]{Msg: message.NewMessage("1", nil)}).Msg.Context()
	require.Equal(t, "sub", c.Value(subscribeKey{}))
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = c.Value(missingKey{}) }))
	cancel(errors.New("the subscription stops"))
	require.NoError(t, c.Err())
	require.NoError(t, context.Cause(c))
}
