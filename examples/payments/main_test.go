package main

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestPayments_RabbitMQToPostgreSQLExactlyOnceDespiteLostAcks(t *testing.T) {
	o := Options{BrokerURL: testsvc.AMQPURL(t), DBURL: testsvc.PostgresSchemaURL(t), Orders: 200, LostAcks: 20}
	s, err := run(context.Background(), o, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)

	require.Equal(t, 200, s.Payments, "each order booked once")
	require.Equal(t, 20, s.Redelivered, "every lost acknowledgement led to a redelivery")
	require.Equal(t, s.Expected, s.Balances, "no money moved twice")
	total := 0
	for _, c := range s.Balances {
		total += c
	}
	require.Zero(t, total, "money is only moved, never created")
}
