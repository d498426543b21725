package amqp_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
)

func TestConfig_ANegativeAckDelayIsRefusedByName(t *testing.T) {
	cfg := amqp.Config{URL: "amqp://127.0.0.1/", Topology: amqp.Topology{ConsumerGroup: "g"}}
	require.NoError(t, cfg.Validate())
	cfg.OutOfOrderAckDelay = -time.Millisecond
	require.ErrorContains(t, cfg.Validate(), "Config.OutOfOrderAckDelay: -1ms is negative")
	cfg.OutOfOrderAckDelay = 0
	cfg.AckDelay = -time.Millisecond
	require.ErrorContains(t, cfg.Validate(), "Config.AckDelay: -1ms is negative")
}
