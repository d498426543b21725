package dedup_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

func newPositions(t *testing.T, db *sqldb.DB) *dedup.Positions {
	t.Helper()
	p, err := dedup.NewPositions(db, dedup.PositionsConfig{Table: testsvc.UniqueName("positions")})
	require.NoError(t, err)
	require.NoError(t, p.Migrate(context.Background()))
	require.NoError(t, p.Migrate(context.Background()), "idempotent")
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE ` + db.Dialect.Quote(p.Table())) })
	return p
}

func TestPositions_LockSetLoad(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := d.Open(t)
			p := newPositions(t, db)

			tx, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			applied, err := p.Lock(ctx, tx, "billing", "orders", 3)
			require.NoError(t, err)
			require.Equal(t, int64(-1), applied, "none applied yet")
			require.NoError(t, p.Set(ctx, tx, "billing", "orders", 3, 41))
			require.NoError(t, tx.Rollback())
			got, err := p.Load(ctx, "billing", "orders")
			require.NoError(t, err)
			require.Empty(t, got, "a rolled-back Set leaves nothing")

			tx, err = db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			_, err = p.Lock(ctx, tx, "billing", "orders", 3)
			require.NoError(t, err)
			require.NoError(t, p.Set(ctx, tx, "billing", "orders", 3, 41))
			require.NoError(t, tx.Commit())

			got, err = p.Load(ctx, "billing", "orders")
			require.NoError(t, err)
			require.Equal(t, map[int32]int64{3: 41}, got)
			got, err = p.Load(ctx, "shipping", "orders")
			require.NoError(t, err)
			require.Empty(t, got, "handlers keep positions apart")

			tx, err = db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			applied, err = p.Lock(ctx, tx, "billing", "orders", 3)
			require.NoError(t, err)
			require.Equal(t, int64(41), applied)
			require.NoError(t, tx.Rollback())
		})
	}
}

// A consumer that takes a partition over while the previous owner's transaction is open waits
// for it, then sees what it recorded.
func TestPositions_SecondOwnerWaitsForTheFirstAndSeesItsOffset(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		if d.Name == "sqlite" {
			continue // one writer at a time: the database itself serialises the owners
		}
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := d.Open(t)
			p := newPositions(t, db)

			first, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			_, err = p.Lock(ctx, first, "billing", "orders", 0)
			require.NoError(t, err)

			second, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			defer func() { _ = second.Rollback() }()
			session := sessionID(t, &env{dialect: db.Dialect, db: db}, second)
			seen := make(chan int64, 1)
			go func() {
				applied, err := p.Lock(ctx, second, "billing", "orders", 0)
				if err != nil {
					applied = -100
				}
				seen <- applied
			}()
			waitForLockWait(t, &env{dialect: db.Dialect, db: db}, session) // the second owner waits
			require.NoError(t, p.Set(ctx, first, "billing", "orders", 0, 7))
			require.NoError(t, first.Commit())
			select {
			case v := <-seen:
				require.Equal(t, int64(7), v)
			case <-time.After(10 * time.Second):
				t.Fatal("the second owner never got the position")
			}
		})
	}
}

// Advance moves a position only to the partition's next message: from a recorded offset below
// it, when nothing after previous is left unapplied; it changes nothing otherwise, and the
// position it moved stays with the transaction.
func TestPositions_AdvanceMovesOnlyToTheNextMessage(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := d.Open(t)
			p := newPositions(t, db)
			advance := func(offset, previous int64, commit bool) bool {
				t.Helper()
				tx, err := db.BeginTxx(ctx, nil)
				require.NoError(t, err)
				ok, err := p.Advance(ctx, tx, "billing", "orders", 2, offset, previous)
				require.NoError(t, err)
				if commit {
					require.NoError(t, tx.Commit())
				} else {
					require.NoError(t, tx.Rollback())
				}
				return ok
			}
			applied := func() map[int32]int64 {
				t.Helper()
				got, err := p.Load(ctx, "billing", "orders")
				require.NoError(t, err)
				return got
			}

			require.False(t, advance(0, -1, true), "no position yet: Lock creates it")
			require.Empty(t, applied())

			tx, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			_, err = p.Lock(ctx, tx, "billing", "orders", 2)
			require.NoError(t, err)
			require.NoError(t, p.Set(ctx, tx, "billing", "orders", 2, 4))
			require.NoError(t, tx.Commit())

			require.True(t, advance(5, 4, false), "the next message")
			require.Equal(t, map[int32]int64{2: 4}, applied(), "rolled back with its transaction")
			require.False(t, advance(4, 3, true), "at the position: a duplicate")
			require.False(t, advance(3, 2, true), "below it: a duplicate")
			require.False(t, advance(7, 5, true), "offset 5, before it, is not applied")
			require.Equal(t, map[int32]int64{2: 4}, applied(), "nothing moved")
			require.True(t, advance(7, 4, true), "a gap in the offsets, nothing unapplied before it")
			require.Equal(t, map[int32]int64{2: 7}, applied())
		})
	}
}
