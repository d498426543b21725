package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/internal/queuetable"
)

// leases is the SQL of one consumer group's leases on one topic (queuetable.LeasesSchema),
// prepared when the subscription starts. Every statement runs in a transaction of the
// caller's, in the file's turn to write, except anyToClaim, which only reads.
//
// An acknowledgement sets the offset's bit in its claim row, which is deleted once every bit
// is set; a nack, or a lease given back, sets the bit and moves the offset to a lease row; when
// a claim's visible_at passes, the offsets it still held move to lease rows, due, handed out
// once. (consumer_group, first_offset, visible_at) names a claim, whose visible_at never
// changes, and (offset, deliveries) a lease row, whose deliveries each claim raises: a
// settlement does nothing to a later claim or lease.
type leases struct {
	group  string
	table  string // quoted name of the leases table
	claims string // quoted name of the claims table

	anyDue, selectDue, renew, orphan, cursor, selectNew, selectNewLeased, insert, insertClaim, advance, release,
	expireClaims, leaseClaimed, ackClaimed, takeClaimed, sweepClaims *sql.Stmt
	// acks[i] deletes ackSizes[i] leases named by (offset, deliveries) in one statement.
	acks [len(ackSizes)]*sql.Stmt
	all  []*sql.Stmt // every statement prepared, for close
}

// ackSizes are the numbers of leases that the prepared deletes of acknowledgements take, largest
// first: a batch of acknowledgements goes in few statements, each prepared once.
var ackSizes = [...]int{64, 8, 1}

// ackManyQuery returns the delete of n leases of a group, named by (offset, deliveries), n
// distinct offsets: its arguments are the group, the n offsets, then each offset with its
// deliveries. The offsets are an IN list, so that SQLite finds each lease by its primary key
// (a row-value IN over (offset, deliveries) would scan the group's leases).
func ackManyQuery(table string, n int) string {
	return `DELETE FROM ` + table + ` WHERE consumer_group = ? AND "offset" IN ` + dbqueue.Marks(n) +
		` AND deliveries = CASE "offset"` + strings.Repeat(" WHEN ? THEN ?", n) + " END"
}

// prepareLeases prepares the statements of group's leases on topic, whose tables must exist.
func prepareLeases(ctx context.Context, db *sql.DB, topic, group string) (*leases, error) {
	messages, offsets, table := quote(MessagesTable(topic)), quote(OffsetsTable(topic)), quote(queuetable.LeasesTable(topic))
	claims := quote(queuetable.ClaimsTable(topic))
	l := &leases{group: group, table: table, claims: claims}
	type statement struct {
		stmt  **sql.Stmt
		query string
	}
	stmts := []statement{
		{&l.anyDue, `SELECT EXISTS (SELECT 1 FROM ` + table + ` WHERE consumer_group = ?1 AND visible_at <= ?2)
	OR EXISTS (SELECT 1 FROM ` + claims + ` WHERE consumer_group = ?1 AND visible_at <= ?2)
	OR EXISTS (SELECT 1 FROM ` + messages + ` WHERE "offset" > COALESCE((SELECT offset_acked FROM ` + offsets + ` WHERE consumer_group = ?1), 0))`},
		{&l.selectDue, `SELECT l."offset", l.deliveries, m.uuid, m.payload, m.metadata
FROM ` + table + ` AS l LEFT JOIN ` + messages + ` AS m ON m."offset" = l."offset"
WHERE l.consumer_group = ? AND l.visible_at <= ?
ORDER BY l.visible_at, l."offset" LIMIT ?`},
		{&l.renew, `UPDATE ` + table + ` SET deliveries = deliveries + 1, visible_at = ? WHERE consumer_group = ? AND "offset" = ?`},
		{&l.orphan, `DELETE FROM ` + table + ` WHERE consumer_group = ? AND "offset" = ?`},
		// The cursor, and the highest offset the group holds a lease of: above the cursor only
		// when the cursor was moved back by hand.
		{&l.cursor, `SELECT COALESCE((SELECT offset_acked FROM ` + offsets + ` WHERE consumer_group = ?1), 0),
	max(COALESCE((SELECT max("offset") FROM ` + table + ` WHERE consumer_group = ?1), 0),
		COALESCE((SELECT max(last_offset) FROM ` + claims + ` WHERE consumer_group = ?1), 0))`},
		{&l.selectNew, `SELECT "offset", uuid, payload, metadata FROM ` + messages + ` WHERE "offset" > ? ORDER BY "offset" LIMIT ?`},
		// A message after the cursor has no lease, unless the cursor was moved back by hand:
		// such a message keeps its lease, and is delivered through it.
		{&l.selectNewLeased, `SELECT "offset", uuid, payload, metadata FROM ` + messages + ` WHERE "offset" > ?2
	AND NOT ` + queuetable.Leased(topic, `"offset"`, `?1`) + ` ORDER BY "offset" LIMIT ?3`},
		{&l.insert, `INSERT INTO ` + table + ` (consumer_group, "offset", deliveries, visible_at) VALUES (?, ?, ?, ?)
ON CONFLICT (consumer_group, "offset") DO NOTHING`},
		{&l.insertClaim, `INSERT INTO ` + claims + ` (consumer_group, first_offset, last_offset, visible_at, settled) VALUES (?, ?, ?, ?, ?)`},
		{&l.advance, `INSERT INTO ` + offsets + ` (consumer_group, offset_acked) VALUES (?, ?)
ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = max(offset_acked, excluded.offset_acked)`},
		{&l.release, `UPDATE ` + table + ` SET visible_at = ?, deliveries = deliveries - ?
WHERE consumer_group = ? AND "offset" = ? AND deliveries = ?`},
		{&l.expireClaims, `DELETE FROM ` + claims + ` WHERE consumer_group = ? AND visible_at <= ?
RETURNING first_offset, last_offset, visible_at, settled`},
		// The offsets an expired claim still held become lease rows, due, handed out once.
		{&l.leaseClaimed, `INSERT INTO ` + table + ` (consumer_group, "offset", deliveries, visible_at)
SELECT ?1, "offset", 1, ?2 FROM ` + messages + `
WHERE "offset" BETWEEN ?3 AND ?4 AND ((?5 >> ("offset" - ?3)) & 1) = 0
ON CONFLICT (consumer_group, "offset") DO NOTHING`},
		{&l.ackClaimed, `UPDATE ` + claims + ` SET settled = settled | ?1 WHERE consumer_group = ?2 AND first_offset = ?3 AND visible_at = ?4`},
		// Takes one offset out of a claim that still holds it; the caller then gives it a lease row.
		{&l.takeClaimed, `UPDATE ` + claims + ` SET settled = settled | ?1
WHERE consumer_group = ?2 AND first_offset = ?3 AND visible_at = ?4 AND (settled & ?1) = 0`},
		{&l.sweepClaims, `DELETE FROM ` + claims + ` WHERE consumer_group = ? AND settled = (((1 << (last_offset - first_offset)) - 1) << 1) | 1`},
	}
	for i, n := range ackSizes {
		stmts = append(stmts, statement{&l.acks[i], ackManyQuery(table, n)})
	}
	for _, st := range stmts {
		stmt, err := db.PrepareContext(ctx, st.query)
		if err != nil {
			l.close()
			return nil, fmt.Errorf("prepare the statements of the leases table %s: %w", table, err)
		}
		*st.stmt = stmt
		l.all = append(l.all, stmt)
	}
	return l, nil
}

// close releases the prepared statements.
func (l *leases) close() {
	for _, st := range l.all {
		_ = st.Close()
	}
}

// unixMilliCeil returns t in Unix milliseconds, rounded up: a lease visible from it is not
// visible before t.
func unixMilliCeil(t time.Time) int64 {
	ms := t.UnixMilli()
	if t.Sub(time.UnixMilli(ms)) > 0 {
		ms++
	}
	return ms
}

// claimRef names a claim row: its first offset and its visible_at. The zero claimRef names
// none: the lease is a lease row.
type claimRef struct {
	first int64
	at    int64 // visible_at, Unix milliseconds
}

// claimedRow is a message claimed with its lease.
type claimedRow struct {
	offset     int64
	deliveries int
	claim      claimRef // the claim row that holds the lease; zero for a lease row
	uuid       string
	payload    []byte
	metadata   []byte
}

// anyToClaim reports whether the group has a lease due at now or a message after its cursor.
// It reads without a transaction, so it never waits for writers.
func (l *leases) anyToClaim(ctx context.Context, now time.Time) (bool, error) {
	var found bool
	if err := l.anyDue.QueryRowContext(ctx, l.group, now.UnixMilli()).Scan(&found); err != nil {
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
	if err := l.expire(ctx, tx, now); err != nil {
		return nil, err
	}
	type dueRow struct {
		claimedRow
		found sql.NullString // the uuid; NULL when the message was deleted: the lease is deleted too
	}
	result, err := tx.StmtContext(ctx, l.selectDue).QueryContext(ctx, l.group, now.UnixMilli(), room)
	rows, err := dbqueue.Rows(result, err, func(r *dueRow) []any {
		return []any{&r.offset, &r.deliveries, &r.found, &r.payload, &r.metadata}
	})
	if err != nil {
		return nil, err
	}
	var due []claimedRow
	for _, r := range rows {
		if !r.found.Valid {
			if _, err := tx.StmtContext(ctx, l.orphan).ExecContext(ctx, l.group, r.offset); err != nil {
				return nil, err
			}
			continue
		}
		r.uuid, r.deliveries = r.found.String, r.deliveries+1
		due = append(due, r.claimedRow)
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

// expire deletes the group's claim rows whose visible_at has passed at now, and gives each
// offset they still held a lease row, due, handed out once.
func (l *leases) expire(ctx context.Context, tx *sql.Tx, now time.Time) error {
	type expired struct{ first, last, at, settled int64 }
	result, err := tx.StmtContext(ctx, l.expireClaims).QueryContext(ctx, l.group, now.UnixMilli())
	list, err := dbqueue.Rows(result, err, func(e *expired) []any { return []any{&e.first, &e.last, &e.at, &e.settled} })
	if err != nil {
		return err
	}
	for _, e := range list {
		if _, err := tx.StmtContext(ctx, l.leaseClaimed).ExecContext(ctx, l.group, e.at, e.first, e.last, e.settled); err != nil {
			return fmt.Errorf("give the expired claim of offsets %d to %d lease rows: %w", e.first, e.last, err)
		}
	}
	return nil
}

func (l *leases) claimNew(ctx context.Context, tx *sql.Tx, until time.Time, room int) ([]claimedRow, error) {
	var cursor, highest int64
	if err := tx.StmtContext(ctx, l.cursor).QueryRowContext(ctx, l.group).Scan(&cursor, &highest); err != nil {
		return nil, err
	}
	// A lease above the cursor (moved back by hand): the messages after the cursor are looked
	// up one by one, and each gets a lease row.
	movedBack := highest > cursor
	query, args := l.selectNew, []any{cursor, room}
	if movedBack {
		query, args = l.selectNewLeased, []any{l.group, cursor, room}
	}
	result, err := tx.StmtContext(ctx, query).QueryContext(ctx, args...)
	fresh, err := dbqueue.Rows(result, err, func(r *claimedRow) []any {
		r.deliveries = 1
		return []any{&r.offset, &r.uuid, &r.payload, &r.metadata}
	})
	if err != nil {
		return nil, err
	}
	if len(fresh) == 0 {
		return nil, nil
	}
	at := unixMilliCeil(until)
	if movedBack {
		insert := tx.StmtContext(ctx, l.insert)
		for _, r := range fresh {
			if _, err := insert.ExecContext(ctx, l.group, r.offset, 1, at); err != nil {
				return nil, err
			}
		}
	} else if err := l.insertClaims(ctx, tx, fresh, at); err != nil {
		return nil, err
	}
	if _, err := tx.StmtContext(ctx, l.advance).ExecContext(ctx, l.group, fresh[len(fresh)-1].offset); err != nil {
		return nil, err
	}
	return fresh, nil
}

// insertClaims writes the claim rows of fresh, messages in offset order that no lease holds,
// leased until at: one row per run of up to queuetable.MaxClaimSpan offsets, the offsets of
// the run that are not in fresh (deleted messages) settled from the start. It names each
// row's claim in fresh.
func (l *leases) insertClaims(ctx context.Context, tx *sql.Tx, fresh []claimedRow, at int64) error {
	insert := tx.StmtContext(ctx, l.insertClaim)
	for len(fresh) > 0 {
		first := fresh[0].offset
		n := 1
		for n < len(fresh) && fresh[n].offset-first < queuetable.MaxClaimSpan {
			n++
		}
		last := fresh[n-1].offset
		held := int64(0)
		for i := range fresh[:n] {
			held |= 1 << (fresh[i].offset - first)
			fresh[i].claim = claimRef{first: first, at: at}
		}
		full := int64(1)<<(last-first+1) - 1
		if _, err := insert.ExecContext(ctx, l.group, first, last, at, full&^held); err != nil {
			return fmt.Errorf("claim offsets %d to %d: %w", first, last, err)
		}
		fresh = fresh[n:]
	}
	return nil
}
