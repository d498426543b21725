package broker_test

import (
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
)

func TestNATSUnmarshal_NeverFails(t *testing.T) {
	t.Parallel()
	m, err := broker.NATSUnmarshal(&nats.Msg{
		Header: nats.Header{
			"_watermill_message_uuid": {"id-1"},
			nats.MsgIdHdr:             {"id-1"},
			"multi":                   {"a", "b"},
			"one":                     {"x"},
			"none":                    {},
		},
		Data: []byte("payload"),
	})
	require.NoError(t, err)
	require.Equal(t, "id-1", m.UUID)
	require.Equal(t, `["a","b"]`, m.Metadata.Get("multi"), "several values become a JSON array")
	require.Equal(t, "x", m.Metadata.Get("one"))
	require.Equal(t, "", m.Metadata.Get("none"))
	_, has := m.Metadata[nats.MsgIdHdr]
	require.False(t, has)
}

func TestNATSUnmarshal_MsgIDOfAForeignProducerIsTheUUID(t *testing.T) {
	t.Parallel()
	m, err := broker.NATSUnmarshal(&nats.Msg{Header: nats.Header{nats.MsgIdHdr: {"ext-7"}}})
	require.NoError(t, err)
	require.Equal(t, "ext-7", m.UUID)

	m, err = broker.NATSUnmarshal(&nats.Msg{Data: []byte("no headers")})
	require.NoError(t, err)
	require.Empty(t, m.UUID)
}

func TestRedisUnmarshal_NeverFails(t *testing.T) {
	t.Parallel()
	m, err := broker.RedisUnmarshal(map[string]any{"payload": "p", "metadata": "not msgpack \xc1", "onceflow_id": "ext-1"})
	require.NoError(t, err)
	require.Empty(t, m.UUID, "no uuid field: empty UUID, not an error")
	require.Equal(t, "p", string(m.Payload))
	require.Equal(t, "ext-1", m.Metadata.Get("onceflow_id"), "fields of other producers become metadata")
	require.Equal(t, "not msgpack \xc1", m.Metadata.Get(broker.HeaderRedisMetadata))

	m, err = broker.RedisUnmarshal(map[string]any{})
	require.NoError(t, err)
	require.Empty(t, m.UUID)
	require.Empty(t, m.Payload)
}
