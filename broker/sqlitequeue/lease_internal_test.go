package sqlitequeue

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// A settlement names its lease by the delivery count: once the lease has expired and been
// claimed again, the late ack or nack of the earlier delivery leaves the new lease alone.
func TestLeases_SettlementOfAnEarlierLeaseDoesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q, err := Open(ctx, filepath.Join(t.TempDir(), "queue.db"), Config{ConsumerGroup: "g"})
	require.NoError(t, err)
	defer func() { require.NoError(t, q.Close()) }()
	require.NoError(t, q.Publisher().Publish("t", message.NewMessage("m", nil)))
	require.NoError(t, q.prepareTopic(ctx, "t", "g"))
	l, err := prepareLeases(ctx, rawDB(q.db), "t", "g")
	require.NoError(t, err)
	defer l.close()

	claim := func(now time.Time, lease time.Duration) []claimedRow {
		var rows []claimedRow
		require.NoError(t, q.write(ctx, func(tx *sql.Tx) error {
			var err error
			rows, err = l.claim(ctx, tx, now, now.Add(lease), 10)
			return err
		}))
		return rows
	}
	settle := func(s settlement) {
		require.NoError(t, q.write(ctx, func(tx *sql.Tx) error { return l.settle(ctx, tx, []settlement{s}) }))
	}
	now := time.Now()
	first := claim(now, time.Second)
	require.Len(t, first, 1)
	require.Equal(t, 1, first[0].deliveries)
	require.Empty(t, claim(now, time.Second), "leased: nothing to claim")

	later := now.Add(2 * time.Second) // the first lease has expired
	second := claim(later, time.Minute)
	require.Len(t, second, 1)
	require.Equal(t, 2, second[0].deliveries)

	settle(settlement{offset: first[0].offset, deliveries: first[0].deliveries, ack: true})
	settle(settlement{offset: first[0].offset, deliveries: first[0].deliveries, visibleAt: later})
	records, err := q.Waiting(ctx, "t", "g", 0, 10)
	require.NoError(t, err)
	require.Len(t, records, 1, "the second lease stands")
	require.Empty(t, claim(later, time.Minute), "and is not due")

	settle(settlement{offset: second[0].offset, deliveries: second[0].deliveries, ack: true})
	n, err := q.Backlog(ctx, "t", "g")
	require.NoError(t, err)
	require.Zero(t, n)
}
