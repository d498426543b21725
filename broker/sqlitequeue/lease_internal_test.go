package sqlitequeue

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
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

// Acknowledgements of a batch are deleted in statements of 64 and 8 leases and the rest one by
// one; each deletes exactly the leases named, by offset and delivery count, and finds them by
// the primary key.
func TestLeases_AcknowledgementsOfABatchDeleteExactlyTheirLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q, err := Open(ctx, filepath.Join(t.TempDir(), "queue.db"), Config{ConsumerGroup: "g"})
	require.NoError(t, err)
	defer func() { require.NoError(t, q.Close()) }()
	const n = 100
	for range n {
		require.NoError(t, q.Publisher().Publish("t", message.NewMessage(watermill.NewUUID(), nil)))
	}
	require.NoError(t, q.prepareTopic(ctx, "t", "g"))
	l, err := prepareLeases(ctx, rawDB(q.db), "t", "g")
	require.NoError(t, err)
	defer l.close()

	var plan string
	require.NoError(t, rawDB(q.db).QueryRowContext(ctx, "EXPLAIN QUERY PLAN "+ackManyQuery(l.table, 2), "g", 1, 2, 1, 1, 2, 1).Scan(new(int), new(int), new(int), &plan))
	require.Contains(t, plan, "PRIMARY KEY (consumer_group=? AND offset=?)")

	now := time.Now()
	var rows []claimedRow
	require.NoError(t, q.write(ctx, func(tx *sql.Tx) error {
		rows, err = l.claim(ctx, tx, now, now.Add(time.Minute), n)
		return err
	}))
	require.Len(t, rows, n)
	// 64 + 8 + 8 + 5 acknowledgements of the first 85 leases, one with a wrong count (an
	// earlier lease: it must stay), and one repeated with the wrong count (the later lease
	// of the same offset, in one batch: the right one goes).
	var acks []settlement
	for _, r := range rows[:85] {
		acks = append(acks, settlement{offset: r.offset, deliveries: r.deliveries, ack: true})
	}
	acks[10].deliveries = 0
	acks = append([]settlement{{offset: rows[20].offset, deliveries: 7, ack: true}}, acks...)
	require.NoError(t, q.write(ctx, func(tx *sql.Tx) error { return l.settle(ctx, tx, acks) }))
	var left []int64
	rs, err := rawDB(q.db).QueryContext(ctx, `SELECT "offset" FROM `+l.table+` ORDER BY "offset"`)
	require.NoError(t, err)
	for rs.Next() {
		var off int64
		require.NoError(t, rs.Scan(&off))
		left = append(left, off)
	}
	require.NoError(t, rs.Err())
	want := []int64{rows[10].offset}
	for _, r := range rows[85:] {
		want = append(want, r.offset)
	}
	require.Equal(t, want, left)
}
