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
	q, l := leasesOf(t, 1)
	claim := func(now time.Time, lease time.Duration) []claimedRow { return claimFor(t, q, l, now, lease, 10) }
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

// Acknowledgements of a batch of lease rows (messages delivered again) are deleted in
// statements of 64 and 8 leases and the rest one by one; each deletes exactly the leases
// named, by offset and delivery count, and finds them by the primary key.
func TestLeases_AcknowledgementsOfABatchDeleteExactlyTheirLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const n = 100
	q, l := leasesOf(t, n)

	var plan string
	require.NoError(t, rawDB(q.db).QueryRowContext(ctx, "EXPLAIN QUERY PLAN "+ackManyQuery(l.table, 2), "g", 1, 2, 1, 1, 2, 1).Scan(new(int), new(int), new(int), &plan))
	require.Contains(t, plan, "PRIMARY KEY (consumer_group=? AND offset=?)")

	now := time.Now()
	claimFor(t, q, l, now, time.Second, n)
	now = now.Add(2 * time.Second) // the claims have expired: their offsets are lease rows
	rows := claimFor(t, q, l, now, time.Minute, n)
	require.Len(t, rows, n)
	require.Equal(t, claimedRow{offset: 1, deliveries: 2}, claimedRow{offset: rows[0].offset, deliveries: rows[0].deliveries, claim: rows[0].claim})
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

// New messages are claimed in claim rows of up to 63 offsets, not a lease row each: an
// acknowledgement settles its offset in the row, a nack moves its offset to a lease row with
// its delay, a deleted message leaves its row, and when the claim expires the offsets it still
// holds are delivered again, with their counts.
func TestLeases_ClaimRowsHoldNewMessagesUntilSettledOrExpired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const n = 100
	q, l := leasesOf(t, n)
	claim := func(now time.Time) []claimedRow { return claimFor(t, q, l, now, time.Minute, n) }
	count := func(query string) int {
		var c int
		require.NoError(t, rawDB(q.db).QueryRowContext(ctx, query).Scan(&c))
		return c
	}
	backlog := func() int64 {
		b, err := q.Backlog(ctx, "t", "g")
		require.NoError(t, err)
		return b
	}

	now := time.Now()
	rows := claim(now)
	require.Len(t, rows, n)
	for i, r := range rows {
		require.Equal(t, int64(i+1), r.offset)
		require.Equal(t, 1, r.deliveries)
	}
	require.Equal(t, claimRef{first: 1, at: unixMilliCeil(now.Add(time.Minute))}, rows[62].claim)
	require.Equal(t, int64(64), rows[63].claim.first)
	require.Equal(t, 2, count(`SELECT count(*) FROM `+l.claims))
	require.Zero(t, count(`SELECT count(*) FROM `+l.table))
	require.EqualValues(t, n, backlog())

	// Acknowledge 1..63 but 5 and 7, nack 7 for a second; acknowledge all of 64..100 but 64,
	// which is deleted.
	var settle []settlement
	for _, r := range rows {
		switch r.offset {
		case 5, 64:
		case 7:
			settle = append(settle, settlement{offset: 7, deliveries: 1, claim: r.claim, visibleAt: now.Add(time.Second)})
		default:
			settle = append(settle, settlement{offset: r.offset, deliveries: 1, claim: r.claim, ack: true})
		}
	}
	deleted, err := q.Delete(ctx, "t", 64)
	require.NoError(t, err)
	require.True(t, deleted)
	require.NoError(t, q.write(ctx, func(tx *sql.Tx) error { return l.settle(ctx, tx, settle) }))
	require.Equal(t, 1, count(`SELECT count(*) FROM `+l.claims), "the second claim row is settled and gone")
	require.Equal(t, 1, count(`SELECT count(*) FROM `+l.table+` WHERE "offset" = 7 AND deliveries = 1`))
	require.EqualValues(t, 2, backlog(), "5 (claimed) and 7 (nacked)")
	waiting, err := q.Waiting(ctx, "t", "g", 0, 10)
	require.NoError(t, err)
	require.Equal(t, []int64{5, 7}, offsetsOf(waiting))
	trimmed, err := q.Trim(ctx, "t")
	require.NoError(t, err)
	require.EqualValues(t, n-3, trimmed, "all but 5, 7 and the deleted 64")

	again := claim(now.Add(1500 * time.Millisecond))
	require.Equal(t, []claimedRow{{offset: 7, deliveries: 2}}, stripped(again), "the nack's delay has passed")
	// The claim of 5 expires: 5 comes again, counted, and a late acknowledgement of the
	// first delivery leaves the new lease alone.
	later := now.Add(2 * time.Minute)
	again = claim(later)
	require.Equal(t, []claimedRow{{offset: 5, deliveries: 2}, {offset: 7, deliveries: 3}}, stripped(again))
	require.Zero(t, count(`SELECT count(*) FROM `+l.claims))
	require.NoError(t, q.write(ctx, func(tx *sql.Tx) error {
		return l.settle(ctx, tx, []settlement{{offset: 5, deliveries: 1, claim: rows[4].claim, ack: true}})
	}))
	require.EqualValues(t, 2, backlog())
}

func offsetsOf(records []Record) []int64 {
	var out []int64
	for _, r := range records {
		out = append(out, r.Offset)
	}
	return out
}

// stripped returns rows with only their offsets and counts.
func stripped(rows []claimedRow) []claimedRow {
	var out []claimedRow
	for _, r := range rows {
		out = append(out, claimedRow{offset: r.offset, deliveries: r.deliveries})
	}
	return out
}

// After the cursor is moved back by hand, the messages after it are claimed again each with a
// lease row, except those the group still holds: they keep their leases.
func TestLeases_CursorMovedBackSkipsLeasedMessages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q, l := leasesOf(t, 4)
	claim := func(now time.Time) []claimedRow { return claimFor(t, q, l, now, time.Minute, 10) }
	now := time.Now()
	rows := claim(now)
	require.Len(t, rows, 4)
	// 1 and 3 acknowledged, 2 nacked for an hour, 4 still held by its claim.
	require.NoError(t, q.write(ctx, func(tx *sql.Tx) error {
		return l.settle(ctx, tx, []settlement{
			{offset: 1, deliveries: 1, claim: rows[0].claim, ack: true},
			{offset: 2, deliveries: 1, claim: rows[1].claim, visibleAt: now.Add(time.Hour)},
			{offset: 3, deliveries: 1, claim: rows[2].claim, ack: true},
		})
	}))
	_, err := rawDB(q.db).ExecContext(ctx, `UPDATE `+quote(OffsetsTable("t"))+` SET offset_acked = 0 WHERE consumer_group = 'g'`)
	require.NoError(t, err)
	require.Equal(t, []claimedRow{{offset: 1, deliveries: 1}, {offset: 3, deliveries: 1}}, stripped(claim(now)))
	require.Empty(t, claim(now))
	n, err := q.Backlog(ctx, "t", "g")
	require.NoError(t, err)
	require.EqualValues(t, 4, n)
}

// leasesOf returns a queue file with n messages on topic "t", known to group "g", and the
// leases of "g" on "t"; both are closed at the end of the test.
func leasesOf(t *testing.T, n int) (*Queue, *leases) {
	t.Helper()
	ctx := context.Background()
	q, err := Open(ctx, filepath.Join(t.TempDir(), "queue.db"), Config{ConsumerGroup: "g"})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, q.Close()) })
	for range n {
		require.NoError(t, q.Publisher().Publish("t", message.NewMessage(watermill.NewUUID(), nil)))
	}
	require.NoError(t, q.prepareTopic(ctx, "t", "g"))
	l, err := prepareLeases(ctx, rawDB(q.db), "t", "g")
	require.NoError(t, err)
	t.Cleanup(l.close)
	return q, l
}

// claimFor claims up to room messages of l at now, each leased for lease.
func claimFor(t *testing.T, q *Queue, l *leases, now time.Time, lease time.Duration, room int) []claimedRow {
	t.Helper()
	ctx := context.Background()
	var rows []claimedRow
	require.NoError(t, q.write(ctx, func(tx *sql.Tx) error {
		var err error
		rows, err = l.claim(ctx, tx, now, now.Add(lease), room)
		return err
	}))
	return rows
}
