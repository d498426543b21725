package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

// settlement is what becomes of one lease: deleted (acknowledged), or made visible again
// from visibleAt (nacked, given back).
type settlement struct {
	offset     int64
	deliveries int      // of the lease settled; a later lease of the message is left alone
	claim      claimRef // the claim row of the lease settled; zero for a lease row
	ack        bool
	visibleAt  time.Time
	// undeliver gives back a lease whose message was never handed to the consumer: the
	// claim's count is taken back.
	undeliver bool
	from      *subscription // that gave it, which waits for it at Close
}

// settle applies settlements. A settlement whose lease is gone (acknowledged, expired and
// claimed again, deleted with its message) does nothing. The acknowledgements of a claim row
// go in one statement; those of lease rows in as few statements as the prepared sizes allow.
func (l *leases) settle(ctx context.Context, tx *sql.Tx, settlements []settlement) error {
	var acks []settlement
	claimed := map[claimRef]int64{} // the acknowledged offsets of each claim row, as its bits
	var order []claimRef
	for _, s := range settlements {
		switch {
		case !s.ack:
		case s.claim != claimRef{}:
			if _, ok := claimed[s.claim]; !ok {
				order = append(order, s.claim)
			}
			claimed[s.claim] |= 1 << (s.offset - s.claim.first)
		default:
			acks = append(acks, s)
		}
	}
	if len(order) > 0 {
		ackClaimed := tx.StmtContext(ctx, l.ackClaimed)
		for _, c := range order {
			n, err := dbqueue.Affected(ackClaimed.ExecContext(ctx, claimed[c], l.group, c.first, c.at))
			if err != nil {
				return fmt.Errorf("acknowledge offsets of the claim from %d: %w", c.first, err)
			}
			if n == 0 {
				// The claim expired: its offsets went to lease rows, handed out once.
				acks = appendClaimed(acks, settlements, c)
			}
		}
		if _, err := tx.StmtContext(ctx, l.sweepClaims).ExecContext(ctx, l.group); err != nil {
			return fmt.Errorf("delete settled claims: %w", err)
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
		back := 0
		if s.undeliver {
			back = 1
		}
		if s.claim != (claimRef{}) {
			taken, err := l.releaseClaimed(ctx, tx, s, back)
			if err != nil {
				return fmt.Errorf("release offset %d: %w", s.offset, err)
			}
			if taken {
				continue
			}
		}
		if release == nil {
			release = tx.StmtContext(ctx, l.release)
		}
		if _, err := release.ExecContext(ctx, unixMilliCeil(s.visibleAt), back, l.group, s.offset, s.deliveries); err != nil {
			return fmt.Errorf("release offset %d: %w", s.offset, err)
		}
	}
	return nil
}

// appendClaimed appends to acks the acknowledgements among settlements of claim c, as
// acknowledgements of lease rows.
func appendClaimed(acks, settlements []settlement, c claimRef) []settlement {
	for _, s := range settlements {
		if s.ack && s.claim == c {
			s.claim = claimRef{}
			acks = append(acks, s)
		}
	}
	return acks
}

// releaseClaimed takes the offset of s, a nack or a lease given back, out of its claim row and
// gives it a lease row visible from s.visibleAt, handed out 1-back times; it reports false
// when the claim no longer holds it (expired, or the message deleted).
func (l *leases) releaseClaimed(ctx context.Context, tx *sql.Tx, s settlement, back int) (bool, error) {
	n, err := dbqueue.Affected(tx.StmtContext(ctx, l.takeClaimed).ExecContext(ctx, int64(1)<<(s.offset-s.claim.first), l.group, s.claim.first, s.claim.at))
	if err != nil || n == 0 {
		return false, err
	}
	_, err = tx.StmtContext(ctx, l.insert).ExecContext(ctx, l.group, s.offset, s.deliveries-back, unixMilliCeil(s.visibleAt))
	return true, err
}

// deleteAcked deletes the leases of acknowledgements in runs of the prepared sizes, one
// statement each, of distinct offsets: the acknowledgements of a second lease of an offset,
// whose first lease is acknowledged in the same batch, go in the next round.
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
				return fmt.Errorf("acknowledge %d leases from offset %d: %w", n, acks[0].offset, err)
			}
			acks = acks[n:]
		}
	}
	if len(again) == 0 {
		return nil
	}
	return l.deleteAcked(ctx, tx, again)
}
