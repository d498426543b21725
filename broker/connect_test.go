package broker_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestOpen_BrokerThatNeverAnswersTimesOut opens every networked scheme on a server that
// accepts the TCP connection and never sends a byte: the handshake, not the dial, is what must
// be bounded.
func TestOpen_BrokerThatNeverAnswersTimesOut(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	for _, tc := range []struct{ scheme, url string }{
		{"amqp", "amqp://app:" + secret + "@%s/"},
		{"nats", "nats://app:" + secret + "@%s"},
		{"redis", "redis://app:" + secret + "@%s/0"},
		{"postgres", "postgres://app:" + secret + "@%s/orders?sslmode=disable"},
		{"mysql", "mysql://app:" + secret + "@%s/orders"},
	} {
		t.Run(tc.scheme, func(t *testing.T) {
			t.Parallel()
			addr := testsvc.SilentListener(t)
			rawURL := withParams(fmt.Sprintf(tc.url, addr), "connect_timeout=300ms")
			start := time.Now()
			b, err := broker.Open(context.Background(), rawURL, broker.Options{})
			elapsed := time.Since(start)
			if err == nil {
				_ = b.Close()
			}
			require.Error(t, err)
			t.Log(err)
			require.GreaterOrEqual(t, elapsed, timeout-10*time.Millisecond, "the wait ended before the timeout")
			require.Less(t, elapsed, timeout+2*time.Second, "Open outlived connect_timeout=300ms")
			require.Contains(t, err.Error(), addr, "the error names the host and port")
			require.Contains(t, err.Error(), "no answer within 300ms (connect_timeout)")
			require.NotContains(t, err.Error(), secret)
		})
	}
}

func TestOpen_ConnectTimeoutFromOptionsAndURL(t *testing.T) {
	t.Parallel()
	addr := testsvc.SilentListener(t)
	start := time.Now()
	_, err := broker.Open(context.Background(), "redis://"+addr+"/0", broker.Options{ConnectTimeout: 200 * time.Millisecond})
	require.ErrorContains(t, err, "no answer within 200ms (connect_timeout)")
	require.Less(t, time.Since(start), 2*time.Second)

	require.Equal(t, 10*time.Second, broker.DefaultConnectTimeout)
	for _, v := range []string{"0", "0s", "-1s", "soon"} {
		_, err := broker.Open(context.Background(), "redis://"+addr+"/0?connect_timeout="+v, broker.Options{})
		require.ErrorContains(t, err, "query parameter connect_timeout=\""+v+"\": want a positive Go duration")
	}
	require.EqualError(t, broker.Options{ConnectTimeout: -time.Second}.Validate(), "broker: Options.ConnectTimeout: -1s is negative (0 selects the default)")
}
