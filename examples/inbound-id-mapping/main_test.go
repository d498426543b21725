package main

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

// On the embedded default, and on RabbitMQ with PostgreSQL and with MariaDB.
func TestInboundIDMapping_OneInternalMessagePerExternalID(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			o := Options{DBURL: d.URL(t), Messages: 60, Resent: 20}
			if d.Name == "sqlite" {
				o.BrokerURL = "sqlite://" + filepath.Join(t.TempDir(), "queue.db")
			} else {
				o.BrokerURL = testsvc.AMQPURL(t)
			}
			s, err := run(context.Background(), o, slog.New(slog.NewTextHandler(io.Discard, nil)))
			require.NoError(t, err)
			require.Equal(t, o.Messages+o.Resent, s.Received)
			require.Equal(t, o.Messages, s.Mappings, "one mapping per external id")
			require.Equal(t, o.Messages, s.Forwarded, "one internal message per external id, resends absorbed")
			require.True(t, s.OneToOne, "each internal message carries the internal id its mapping holds")
			require.True(t, s.TimeOrdered, "internal ids sort in the order they were minted")
			require.InDelta(t, 24, s.ExpiresInHour, 0.001, "mappings expire after 24 h")
		})
	}
}
