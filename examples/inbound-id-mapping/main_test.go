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

func check(t *testing.T, o Options) {
	t.Helper()
	s, err := run(context.Background(), o, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	require.Equal(t, o.Messages+o.Resent, s.Received)
	require.Equal(t, o.Messages, s.Mappings, "one mapping per external id")
	require.Equal(t, o.Messages, s.Forwarded, "one internal message per external id, resends absorbed")
	require.True(t, s.OneToOne, "each internal message carries the internal id its mapping holds")
	require.True(t, s.TimeOrdered, "internal ids sort in the order they were minted")
	require.InDelta(t, 24, s.ExpiresInHour, 0.001, "mappings expire after 24 h")
}

func TestInboundIDMapping_EmbeddedDefault(t *testing.T) {
	dir := t.TempDir()
	check(t, Options{BrokerURL: "sqlite://" + filepath.Join(dir, "queue.db"), DBURL: "sqlite://" + filepath.Join(dir, "app.db"), Messages: 60, Resent: 20})
}

func TestInboundIDMapping_RabbitMQAndPostgreSQL(t *testing.T) {
	check(t, Options{BrokerURL: testsvc.AMQPURL(t), DBURL: testsvc.PostgresSchemaURL(t), Messages: 60, Resent: 20})
}
