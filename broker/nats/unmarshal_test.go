package nats_test

import (
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
)

func TestUnmarshal_NeverFails(t *testing.T) {
	t.Parallel()
	m := natsbroker.Unmarshal(&nats.Msg{
		Header: nats.Header{
			"_watermill_message_uuid": {"id-1"},
			nats.MsgIdHdr:             {"id-1"},
			"multi":                   {"a", "b"},
			"one":                     {"x"},
			"none":                    {},
		},
		Data: []byte("payload"),
	})
	require.Equal(t, "id-1", m.UUID)
	require.Equal(t, `["a","b"]`, m.Metadata.Get("multi"), "several values become a JSON array")
	require.Equal(t, "x", m.Metadata.Get("one"))
	require.Equal(t, "", m.Metadata.Get("none"))
	_, has := m.Metadata[nats.MsgIdHdr]
	require.False(t, has)
}

func TestUnmarshal_MsgIDOfAForeignProducerIsTheUUID(t *testing.T) {
	t.Parallel()
	m := natsbroker.Unmarshal(&nats.Msg{Header: nats.Header{nats.MsgIdHdr: {"ext-7"}}})
	require.Equal(t, "ext-7", m.UUID)

	m = natsbroker.Unmarshal(&nats.Msg{Data: []byte("no headers")})
	require.Empty(t, m.UUID)
}
