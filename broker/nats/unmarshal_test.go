package nats_test

import (
	"testing"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/stretchr/testify/require"

	natsbroker "github.com/onceflow/onceflow/broker/nats"
)

// The publisher is watermill-nats's: the subscriber must read the UUID where it writes it.
func TestUUIDHeader_IsWatermillNATSHeader(t *testing.T) {
	require.Equal(t, wnats.WatermillUUIDHdr, natsbroker.UUIDHeader)
}
