package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// leases is the SQL of one consumer group's leases on one topic: claiming messages, settling
// them, and looking whether there is anything to claim. Every statement runs in a transaction
// of the caller's, in the file's turn to write, except anyToClaim, which only reads. The
// statements are prepared once, when the subscription starts.
//
// The group's row in the offsets table is its cursor: every offset at or below it is
// acknowledged (its lease deleted, or never had one before the queue had leases) or leased.
// A lease row is (consumer_group, offset, deliveries, visible_at): the message at offset was
// handed out deliveries times, and may be claimed again from visible_at on, in Unix
// milliseconds. Each claim raises deliveries by one, so that (offset, deliveries) names one
// lease: a settlement names the lease it settles and does nothing to a later one.
type leases struct {
	group string
	table string // quoted name of the leases table

	anyDue, selectDue, renew, orphan, cursor, selectNew, insert, advance, ack, release *sql.Stmt
	// acks[i] deletes ackSizes[i] leases named by (offset, deliveries) in one statement.
	acks [len(ackSizes)]*sql.Stmt
}

// ackSizes are the numbers of leases that the prepared deletes of acknowledgements take, largest
// first: a batch of acknowledgements goes in few statements, each prepared once.
var ackSizes = [...]int{64, 8}

// ackManyQuery returns the delete of n leases of a group, named by (offset, deliveries), n
// distinct offsets: its arguments are the group, the n offsets, then each offset with its
// deliveries. The offsets are an IN list, so that SQLite finds each lease by its primary key
// (a row-value IN over (offset, deliveries) would scan the group's leases).
func ackManyQuery(table string, n int) string {
	var b strings.Builder
	b.WriteString(`DELETE FROM ` + table + ` WHERE consumer_group = ? AND "offset" IN (`)
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("?")
	}
	b.WriteString(`) AND deliveries = CASE "offset"`)
	for range n {
		b.WriteString(" WHEN ? THEN ?")
	}
	b.WriteString(" END")
	return b.String()
}

// prepareLeases prepares the statements of group's leases on topic, whose tables must exist.
func prepareLeases(ctx context.Context, db *sql.DB, topic, group string) (*leases, error) {
	messages, offsets, table := quote(MessagesTable(topic)), quote(OffsetsTable(topic)), quote(LeasesTable(topic))
	l := &leases{group: group, table: table}
	for _, st := range []struct {
		stmt  **sql.Stmt
		query string
	}{
		{&l.anyDue, `SELECT EXISTS (SELECT 1 FROM ` + table + ` WHERE consumer_group = ? AND visible_at <= ?)
	OR EXISTS (SELECT 1 FROM ` + messages + ` WHERE "offset" > COALESCE((SELECT offset_acked FROM ` + offsets + ` WHERE consumer_group = ?), 0))`},
		{&l.selectDue, `SELECT l."offset", l.deliveries, m.uuid, m.payload, m.metadata
FROM ` + table + ` AS l LEFT JOIN ` + messages + ` AS m ON m."offset" = l."offset"
WHERE l.consumer_group = ? AND l.visible_at <= ?
ORDER BY l.visible_at, l."offset" LIMIT ?`},
		{&l.renew, `UPDATE ` + table + ` SET deliveries = deliveries + 1, visible_at = ? WHERE consumer_group = ? AND "offset" = ?`},
		{&l.orphan, `DELETE FROM ` + table + ` WHERE consumer_group = ? AND "offset" = ?`},
		{&l.cursor, `SELECT COALESCE((SELECT offset_acked FROM ` + offsets + ` WHERE consumer_group = ?), 0)`},
		{&l.selectNew, `SELECT "offset", uuid, payload, metadata FROM ` + messages + ` WHERE "offset" > ? ORDER BY "offset" LIMIT ?`},
		// A message after the cursor has no lease, unless the cursor was moved back by hand:
		// such a message keeps its lease, and is delivered through it.
		{&l.insert, `INSERT INTO ` + table + ` (consumer_group, "offset", deliveries, visible_at)
SELECT ?, "offset", 1, ? FROM ` + messages + ` WHERE "offset" > ? AND "offset" <= ?
ON CONFLICT (consumer_group, "offset") DO NOTHING
RETURNING "offset"`},
		{&l.advance, `INSERT INTO ` + offsets + ` (consumer_group, offset_acked) VALUES (?, ?)
ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = max(offset_acked, excluded.offset_acked)`},
		{&l.ack, `DELETE FROM ` + table + ` WHERE consumer_group = ? AND "offset" = ? AND deliveries = ?`},
		{&l.release, `UPDATE ` + table + ` SET visible_at = ?, deliveries = deliveries - ?
WHERE consumer_group = ? AND "offset" = ? AND deliveries = ?`},
	} {
		stmt, err := db.PrepareContext(ctx, st.query)
		if err != nil {
			l.close()
			return nil, fmt.Errorf("prepare the statements of the leases table %s: %w", table, err)
		}
		*st.stmt = stmt
	}
	for i, n := range ackSizes {
		stmt, err := db.PrepareContext(ctx, ackManyQuery(table, n))
		if err != nil {
			l.close()
			return nil, fmt.Errorf("prepare the statements of the leases table %s: %w", table, err)
		}
		l.acks[i] = stmt
	}
	return l, nil
}

// close releases the prepared statements.
func (l *leases) close() {
	for _, st := range append([]*sql.Stmt{l.anyDue, l.selectDue, l.renew, l.orphan, l.cursor, l.selectNew, l.insert, l.advance, l.ack, l.release}, l.acks[:]...) {
		if st != nil {
			_ = st.Close()
		}
	}
}

// unixMilli returns t in Unix milliseconds, rounded down.
func unixMilli(t time.Time) int64 { return t.UnixMilli() }

// unixMilliCeil returns t in Unix milliseconds, rounded up: a lease visible from it is not
// visible before t.
func unixMilliCeil(t time.Time) int64 {
	ms := t.UnixMilli()
	if t.Sub(time.UnixMilli(ms)) > 0 {
		ms++
	}
	return ms
}

// claimedRow is a message claimed with its lease.
type claimedRow struct {
	offset     int64
	deliveries int
	uuid       string
	payload    []byte
	metadata   sql.NullString
}

// anyToClaim reports whether the group has a lease due at now or a message after its cursor.
// It reads without a transaction, so it never waits for writers.
func (l *leases) anyToClaim(ctx context.Context, now time.Time) (bool, error) {
	var found bool
	if err := l.anyDue.QueryRowContext(ctx, l.group, unixMilli(now), l.group).Scan(&found); err != nil {
		return false, fmt.Errorf("look for messages to claim: %w", err)
	}
	return found, nil
}

// claim claims up to room messages at now, each with a lease until until: first the group's
// leases due at now, longest due first, then the messages after its cursor, in offset order,
// moving the cursor past them. It returns them in that order, each with its deliveries after
// the claim. A lease whose message has been deleted is deleted.
func (l *leases) claim(ctx context.Context, tx *sql.Tx, now, until time.Time, room int) ([]claimedRow, error) {
	due, err := l.claimDue(ctx, tx, now, until, room)
	if err != nil {
		return nil, fmt.Errorf("claim due leases: %w", err)
	}
	if len(due) == room {
		return due, nil
	}
	fresh, err := l.claimNew(ctx, tx, until, room-len(due))
	if err != nil {
		return nil, fmt.Errorf("claim new messages: %w", err)
	}
	return append(due, fresh...), nil
}

func (l *leases) claimDue(ctx context.Context, tx *sql.Tx, now, until time.Time, room int) ([]claimedRow, error) {
	rows, err := tx.StmtContext(ctx, l.selectDue).QueryContext(ctx, l.group, unixMilli(now), room)
	if err != nil {
		return nil, err
	}
	var (
		due     []claimedRow
		orphans []int64
	)
	for rows.Next() {
		var (
			r    claimedRow
			uuid sql.NullString
		)
		if err := rows.Scan(&r.offset, &r.deliveries, &uuid, &r.payload, &r.metadata); err != nil {
			_ = rows.Close()
			return nil, err
		}
		if !uuid.Valid {
			orphans = append(orphans, r.offset)
			continue
		}
		r.uuid = uuid.String
		r.deliveries++
		due = append(due, r)
	}
	if err := rows.Close(); err != nil {
		return nil, err
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	for _, off := range orphans {
		if _, err := tx.StmtContext(ctx, l.orphan).ExecContext(ctx, l.group, off); err != nil {
			return nil, err
		}
	}
	if len(due) > 0 {
		renew := tx.StmtContext(ctx, l.renew)
		for _, r := range due {
			if _, err := renew.ExecContext(ctx, unixMilliCeil(until), l.group, r.offset); err != nil {
				return nil, err
			}
		}
	}
	return due, nil
}

func (l *leases) claimNew(ctx context.Context, tx *sql.Tx, until time.Time, room int) ([]claimedRow, error) {
	var cursor int64
	if err := tx.StmtContext(ctx, l.cursor).QueryRowContext(ctx, l.group).Scan(&cursor); err != nil {
		return nil, err
	}
	rows, err := tx.StmtContext(ctx, l.selectNew).QueryContext(ctx, cursor, room)
	if err != nil {
		return nil, err
	}
	var fresh []claimedRow
	for rows.Next() {
		r := claimedRow{deliveries: 1}
		if err := rows.Scan(&r.offset, &r.uuid, &r.payload, &r.metadata); err != nil {
			_ = rows.Close()
			return nil, err
		}
		fresh = append(fresh, r)
	}
	if err := rows.Close(); err != nil {
		return nil, err
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(fresh) == 0 {
		return nil, nil
	}
	last := fresh[len(fresh)-1].offset
	inserted, err := tx.StmtContext(ctx, l.insert).QueryContext(ctx, l.group, unixMilliCeil(until), cursor, last)
	if err != nil {
		return nil, err
	}
	leased := make(map[int64]bool, len(fresh))
	for inserted.Next() {
		var off int64
		if err := inserted.Scan(&off); err != nil {
			_ = inserted.Close()
			return nil, err
		}
		leased[off] = true
	}
	if err := inserted.Close(); err != nil {
		return nil, err
	}
	if err := inserted.Err(); err != nil {
		return nil, err
	}
	if _, err := tx.StmtContext(ctx, l.advance).ExecContext(ctx, l.group, last); err != nil {
		return nil, err
	}
	if len(leased) == len(fresh) {
		return fresh, nil
	}
	kept := fresh[:0]
	for _, r := range fresh {
		if leased[r.offset] {
			kept = append(kept, r)
		}
	}
	return kept, nil
}

// settlement is what becomes of one lease: deleted (acknowledged), or made visible again
// from visibleAt (nacked, given back).
type settlement struct {
	offset     int64
	deliveries int // of the lease settled; a later lease of the message is left alone
	ack        bool
	visibleAt  time.Time
	// undeliver gives back a lease whose message was never handed to the consumer: the
	// claim's count is taken back.
	undeliver bool
}

// settle applies settlements. A settlement whose lease is gone (acknowledged, expired and
// claimed again, deleted with its message) does nothing. The acknowledgements go in as few
// statements as the prepared sizes allow.
func (l *leases) settle(ctx context.Context, tx *sql.Tx, settlements []settlement) error {
	var acks []settlement
	for _, s := range settlements {
		if s.ack {
			acks = append(acks, s)
		}
	}
	if err := l.deleteAcked(ctx, tx, acks); err != nil {
		return err
	}
	var release *sql.Stmt
	for _, s := range settlements {
		if s.ack {
			continue
		}
		if release == nil {
			release = tx.StmtContext(ctx, l.release)
		}
		back := 0
		if s.undeliver {
			back = 1
		}
		if _, err := release.ExecContext(ctx, unixMilliCeil(s.visibleAt), back, l.group, s.offset, s.deliveries); err != nil {
			return fmt.Errorf("release offset %d: %w", s.offset, err)
		}
	}
	return nil
}

// deleteAcked deletes the leases of acknowledgements: runs of the prepared sizes, one
// statement each, and the rest one by one (so are the acknowledgements of a second lease of
// an offset, whose first lease is acknowledged in the same batch).
func (l *leases) deleteAcked(ctx context.Context, tx *sql.Tx, acks []settlement) error {
	seen := make(map[int64]bool, len(acks))
	var again []settlement
	distinct := acks[:0:0]
	for _, s := range acks {
		if seen[s.offset] {
			again = append(again, s)
			continue
		}
		seen[s.offset] = true
		distinct = append(distinct, s)
	}
	acks = distinct
	for i, n := range ackSizes {
		var stmt *sql.Stmt
		for len(acks) >= n {
			if stmt == nil {
				stmt = tx.StmtContext(ctx, l.acks[i])
			}
			args := make([]any, 0, 1+3*n)
			args = append(args, l.group)
			for _, s := range acks[:n] {
				args = append(args, s.offset)
			}
			for _, s := range acks[:n] {
				args = append(args, s.offset, s.deliveries)
			}
			if _, err := stmt.ExecContext(ctx, args...); err != nil {
				return fmt.Errorf("acknowledge %d offsets from %d: %w", n, acks[0].offset, err)
			}
			acks = acks[n:]
		}
	}
	acks = append(acks, again...)
	if len(acks) == 0 {
		return nil
	}
	ack := tx.StmtContext(ctx, l.ack)
	for _, s := range acks {
		if _, err := ack.ExecContext(ctx, l.group, s.offset, s.deliveries); err != nil {
			return fmt.Errorf("acknowledge offset %d: %w", s.offset, err)
		}
	}
	return nil
}
