package main

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/sqldb"
)

// The page's program on the embedded default, and on RabbitMQ with PostgreSQL and with
// MariaDB: order-1 and order-2 booked once each, order-3 dead-lettered for its missing tenant.
func TestGettingStarted_BooksEachOrderOnceAndRefusesOneWithoutTenant(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			brokerURL := "sqlite://" + filepath.Join(t.TempDir(), "queue.db")
			topic := testsvc.UniqueName("orders")
			if d.Name != "sqlite" {
				brokerURL = testsvc.AMQPURL(t)
				t.Cleanup(func() { testsvc.RemoveTopics(t, brokerURL, []string{"orders"}, topic) })
			}
			dbURL := d.URL(t)
			ctx, stop := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- run(ctx, brokerURL, dbURL, topic, true) }()

			db, err := sqldb.Open(context.Background(), dbURL)
			require.NoError(t, err)
			defer db.Close()
			var rows []struct {
				ID     string `db:"order_id"`
				Tenant string `db:"tenant"`
			}
			testsvc.Eventually(t, time.Minute, func() bool {
				rows = nil
				err := db.Select(&rows, `SELECT order_id, tenant FROM orders ORDER BY order_id`)
				return err == nil && len(rows) >= 2
			}, "the orders were not booked")

			// The dead letter of order-3, taken off the dead-letter topic.
			b, err := broker.Open(context.Background(), brokerURL, broker.Options{ConsumerGroup: "orders"})
			require.NoError(t, err)
			defer b.Close()
			var dead []*message.Message
			testsvc.Eventually(t, time.Minute, func() bool {
				report, err := b.Delete(context.Background(), onceflow.DefaultDeadLetterTopic, 1000, func(m *message.Message) bool {
					return m.Metadata.Get(messagedata.HeaderDeadLetterTopic) == topic
				})
				dead = append(dead, report.Deleted...)
				return err == nil && len(dead) > 0
			}, "order-3 was not dead-lettered")

			stop()
			require.NoError(t, <-done)
			require.Len(t, rows, 2)
			require.Equal(t, "order-1", rows[0].ID)
			require.Equal(t, "order-2", rows[1].ID, "order-2, delivered twice, is booked once")
			require.Equal(t, "acme", rows[1].Tenant)
			require.Len(t, dead, 1)
			require.Equal(t, "order-3", dead[0].UUID)
			require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "no tenant header")
			var booked int
			require.NoError(t, db.Get(&booked, `SELECT COUNT(*) FROM orders`))
			require.Equal(t, 2, booked, "nothing was booked after the dead letter")
		})
	}
}
