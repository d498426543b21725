package redis_test

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	redissub "github.com/onceflow/onceflow/broker/redis"
)

func TestMarshaller_RoundTripsWatermillMessages(t *testing.T) {
	t.Parallel()
	in := message.NewMessage("id-1", []byte("payload \x00\xff"))
	in.Metadata.Set("k", "v")
	in.Metadata.Set("empty", "")
	values, err := redissub.Marshaller{}.Marshal("orders", in)
	require.NoError(t, err)

	// go-redis reads every field back as a string.
	read := map[string]any{}
	for k, v := range values {
		switch v := v.(type) {
		case []byte:
			read[k] = string(v)
		default:
			read[k] = fmt.Sprint(v)
		}
	}
	out, err := redissub.Marshaller{}.Unmarshal(read)
	require.NoError(t, err)
	require.Equal(t, in.UUID, out.UUID)
	require.Equal(t, string(in.Payload), string(out.Payload))
	require.Equal(t, in.Metadata, out.Metadata)
}

func TestMarshaller_UnmarshalNeverFails(t *testing.T) {
	t.Parallel()
	m, err := redissub.Marshaller{}.Unmarshal(map[string]any{"payload": "p", "metadata": "not msgpack \xc1", "onceflow_id": "ext-1"})
	require.NoError(t, err)
	require.Empty(t, m.UUID, "no uuid field: empty UUID, not an error")
	require.Equal(t, "p", string(m.Payload))
	require.Equal(t, "ext-1", m.Metadata.Get("onceflow_id"), "fields of other producers become metadata")
	require.Equal(t, "not msgpack \xc1", m.Metadata.Get(broker.HeaderRedisMetadata))

	m, err = redissub.Marshaller{}.Unmarshal(map[string]any{})
	require.NoError(t, err)
	require.Empty(t, m.UUID)
	require.Empty(t, m.Payload)
}
