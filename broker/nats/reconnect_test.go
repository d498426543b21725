package nats_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
	"github.com/onceflow/onceflow/internal/tcpproxy"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// proxy starts an in-process TCP proxy in front of the NATS server of rawURL, stopped when the
// test ends, and returns it with the URL through it.
func proxy(t *testing.T, rawURL string) (*tcpproxy.Proxy, string) {
	t.Helper()
	p, through, err := tcpproxy.ForURL(rawURL)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p, through
}

// restart accepts connections through p again, on the same address.
func restart(t *testing.T, p *tcpproxy.Proxy) {
	t.Helper()
	require.NoError(t, p.Restore())
}

func TestSubscriber_LostConnectionEndsTheDeliveriesInFlightAndTheSubscriptionGoesOn(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		p, through := proxy(t, f.url)
		const n = 5
		first := f.publish(0, n)
		ch := f.subscribe(f.subscriber(natsbroker.Config{
			URL:            through,
			Prefetch:       n,
			AckWait:        2 * time.Second,
			ConnectOptions: []nats.Option{nats.ReconnectWait(50 * time.Millisecond), nats.ReconnectJitter(0, 0)},
		}))
		var held []*message.Message
		for range n {
			m := testsvc.Receive(t, ch, within)
			require.Equal(t, 1, testsvc.Info(t, m).Count)
			held = append(held, m)
		}

		p.Cut() // closes the connections through the proxy, both ways
		for _, m := range held {
			testsvc.RequireCause(t, m, natsbroker.ErrConnectionLost, within)
			m.Ack() // the delivery has ended: ignored
		}
		restart(t, p)

		// The server delivers the lost deliveries again after AckWait, and the subscription takes
		// new messages too.
		second := f.publish(n, 2*n)
		want := map[string]int{}
		for _, id := range first {
			want[id] = 2
		}
		for _, id := range second {
			want[id] = 1
		}
		got := map[string]int{}
		for range 2 * n {
			m := testsvc.Receive(t, ch, within)
			_, seen := got[m.UUID]
			require.False(t, seen, "message %s delivered twice after the reconnection", m.UUID)
			got[m.UUID] = testsvc.Info(t, m).Count
			m.Ack()
		}
		require.Equal(t, want, got, "delivery counts after the reconnection")
		testsvc.RequireOpenAndNothing(t, ch, 3*time.Second) // more than AckWait: the acks after the reconnection hold
	})
}

func TestSubscriber_CloseReturnsInTimeWhenTheServerIsGone(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		p, through := proxy(t, f.url)
		f.publish(0, 1)
		s := f.subscriber(natsbroker.Config{URL: through, CloseTimeout: time.Second})
		ch := f.subscribe(s)
		m := testsvc.Receive(t, ch, within)
		p.Cut()
		testsvc.RequireCause(t, m, natsbroker.ErrConnectionLost, within)
		m.Ack() // the delivery has ended: ignored

		start := time.Now()
		err := s.Close()
		require.Less(t, time.Since(start), 3*time.Second)
		require.ErrorContains(t, err, "may not have reached the server")
		_, open := <-ch
		require.False(t, open, "channel closed by Close")
	})
}
