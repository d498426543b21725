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

// On the embedded default, and on RabbitMQ with PostgreSQL (the tech tip's pair) and with
// MariaDB.
func TestPayments_ExactlyOnceDespiteLostAcks(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			o := Options{DBURL: d.URL(t), Orders: 200, LostAcks: 20}
			if d.Name == "sqlite" {
				o.BrokerURL = "sqlite://" + filepath.Join(t.TempDir(), "queue.db")
			} else {
				o.BrokerURL = testsvc.AMQPURL(t)
			}
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
		})
	}
}
