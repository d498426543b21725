package deadletter

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

func TestReplayMessage_DropsTheDeadLetterHeadersAndCountsReplays(t *testing.T) {
	t.Parallel()
	dead := message.NewMessage("m-1", []byte("x"))
	dead.Metadata = message.Metadata{
		messagedata.HeaderDeadLetterReason:  "bad",
		messagedata.HeaderDeadLetterHandler: "h",
		messagedata.HeaderDeadLetterAttempt: "3",
		messagedata.HeaderDeadLetterTopic:   "orders",
		messagedata.HeaderDeadLetterTime:    "2026-01-01T00:00:00Z",
		messagedata.HeaderDeadLetterKey:     "01JX0000000000000000000000",
		messagedata.HeaderReplayCount:       "1",
		broker.HeaderAMQPRedelivered:        "true",
		messagedata.HeaderAMQPMessageID:     "m-1",
		messagedata.HeaderTimestamp:         "2025-12-31T23:59:59Z",
		"traceparent":                       "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
	}
	out := replayMessage(dead, time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC))
	require.Equal(t, "m-1", out.UUID)
	require.Equal(t, "x", string(out.Payload))
	require.Equal(t, message.Metadata{
		messagedata.HeaderReplayCount: "2",
		messagedata.HeaderReplayTime:  "2026-01-02T00:00:00Z",
		messagedata.HeaderTimestamp:   "2025-12-31T23:59:59Z",
		"traceparent":                 "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
	}, out.Metadata)

	// A dead letter that could not carry its message's id is replayed under the original.
	dead.UUID = "derived"
	dead.Metadata[messagedata.HeaderDeadLetterOriginalID] = "m-1"
	require.Equal(t, "m-1", replayMessage(dead, time.Now()).UUID)
}
