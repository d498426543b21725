package nats

import (
	"math"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

func TestNumDelivered_ReadsTheCountAsNatsGoDoes(t *testing.T) {
	t.Parallel()
	for _, reply := range []string{
		"$JS.ACK.S.C.1.10.7.1700000000000000000.0",
		"$JS.ACK.S.C.42.10.7.1700000000000000000.3",
		"$JS.ACK._.ACCHASH.S.C.3.10.7.1700000000000000000.0.RND",
		"$JS.ACK.dom.ACCHASH.S.C.17.10.7.1700000000000000000.0",
		"$JS.ACK.dom.ACCHASH.S.C.5.10.7.1700000000000000000.0.RND.more",
		"$JS.ACK.S.C.x1.10.7.1700000000000000000.0",
		"$JS.ACK.S.C..10.7.1700000000000000000.0",
	} {
		meta, err := (&nats.Msg{Reply: reply, Sub: &nats.Subscription{}}).Metadata()
		require.NoError(t, err, reply)
		n, ok := numDelivered(reply)
		require.True(t, ok, reply)
		require.Equal(t, int(meta.NumDelivered), n, reply)
	}
	for _, reply := range []string{
		"",
		"_INBOX.abc",
		"$JS.ACK.S.C.1.10.7.1700000000000000000", // 8 tokens
		"$JS.ACK.S.C.1.10.7.1700000000000000000.0.X",          // 10 tokens
		"$JS.NAK.S.C.1.10.7.1700000000000000000.0",            // not an ack subject
		"JS.ACK.dom.ACCHASH.S.C.5.10.7.1700000000000000000.0", // no $
	} {
		_, err := (&nats.Msg{Reply: reply, Sub: &nats.Subscription{}}).Metadata()
		require.Error(t, err, reply)
		_, ok := numDelivered(reply)
		require.False(t, ok, reply)
	}
	n, ok := numDelivered("$JS.ACK.S.C.99999999999999.10.7.1700000000000000000.0")
	require.True(t, ok)
	require.Equal(t, math.MaxInt32, n, "capped")
}

func BenchmarkNumDelivered(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := numDelivered("$JS.ACK._.ACCHASH.STREAM.CONSUMER.3.1000.900.1700000000000000000.12.RND"); !ok {
			b.Fatal("not read")
		}
	}
}
