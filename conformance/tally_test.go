package conformance

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
)

// The consumers learn of a lost acknowledgement from the router's log record: its error wraps
// onceflow.ErrAckLost; no other record counts.
func TestAckLostReporter_ReportsTheRecordsWhoseErrorIsAnAckLost(t *testing.T) {
	var got []string
	logger := slog.New(ackLostReporter{Handler: slog.NewTextHandler(io.Discard, nil), report: func(id string) { got = append(got, id) }}).
		With("handler", "h")
	logger.Warn("acknowledgement lost; the broker will deliver the message again", "message_id", "m1",
		"error", fmt.Errorf("%w: the delivery ended before the acknowledgement", onceflow.ErrAckLost))
	logger.Warn("message processing failed", "message_id", "m2", "error", errors.New("boom"))
	logger.Warn("acknowledgement lost", "message_id", "m3")
	require.Equal(t, []string{"m1"}, got)
}
