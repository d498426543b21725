package testsvc

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// Receive returns the next message of ch, a subscription's channel, failing t when ch closes
// first or no message comes within timeout.
func Receive(t testing.TB, ch <-chan *message.Message, timeout time.Duration) *message.Message {
	t.Helper()
	return ReceiveOr(t, ch, timeout, nil)
}

// ReceiveOr is Receive whose failure after timeout also says what explain returns (the
// broker's state), unless explain is nil.
func ReceiveOr(t testing.TB, ch <-chan *message.Message, timeout time.Duration, explain func() string) *message.Message {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case m, ok := <-ch:
		require.True(t, ok, "subscription closed before a message arrived")
		return m
	case <-timer.C:
		if explain != nil {
			t.Fatalf("no message within %s; %s", timeout, explain())
		}
		t.Fatalf("no message within %s", timeout)
		return nil
	}
}

// ReceiveN returns the next n messages of ch, each within timeout, as Receive.
func ReceiveN(t testing.TB, ch <-chan *message.Message, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	out := make([]*message.Message, n)
	for i := range out {
		out[i] = Receive(t, ch, timeout)
	}
	return out
}

// RequireNothing fails t when ch hands out a message within d. A channel that closes hands
// out nothing: it passes, at once. It is the only way to see that something does not
// happen; d bounds the check, it synchronises nothing.
func RequireNothing(t testing.TB, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	nothing(t, ch, d, false)
}

// RequireOpenAndNothing is RequireNothing for a subscription that must stay open: a channel
// that closes within d fails t too.
func RequireOpenAndNothing(t testing.TB, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	nothing(t, ch, d, true)
}

func nothing(t testing.TB, ch <-chan *message.Message, d time.Duration, open bool) {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case m, ok := <-ch:
		if ok {
			t.Fatalf("unexpected message %s (payload %q)", m.UUID, m.Payload)
		}
		if open {
			t.Fatal("subscription closed")
		}
	case <-timer.C:
	}
}

// Info returns the redelivery.Info in the context of m, failing t when there is none.
func Info(t testing.TB, m *message.Message) redelivery.Info {
	t.Helper()
	i, ok := redelivery.FromContext(m.Context())
	require.True(t, ok, "message %s has no redelivery.Info", m.UUID)
	return i
}

// RequireCause waits up to timeout for the context of m to end, and checks that its cause is
// want (errors.Is).
func RequireCause(t testing.TB, m *message.Message, want error, timeout time.Duration) {
	t.Helper()
	RequireDone(t, m.Context(), timeout, "message "+m.UUID)
	require.ErrorIs(t, context.Cause(m.Context()), want)
}

// RequireDone fails t unless ctx is done within timeout; what names ctx in the failure.
func RequireDone(t testing.TB, ctx context.Context, timeout time.Duration, what string) {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-ctx.Done():
	case <-timer.C:
		t.Fatalf("the context of %s is not cancelled after %s", what, timeout)
	}
}
