package sqltx_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/sqltx"
)

// fakeTx records what Do did with it.
type fakeTx struct {
	commitErr          error
	commits, rollbacks int
}

func (t *fakeTx) Commit() error   { t.commits++; return t.commitErr }
func (t *fakeTx) Rollback() error { t.rollbacks++; return nil }

func begin(tx *fakeTx) func(context.Context) (*fakeTx, error) {
	return func(context.Context) (*fakeTx, error) { return tx, nil }
}

func TestDo_CommitsWorkThatSucceeds(t *testing.T) {
	tx := &fakeTx{}
	require.NoError(t, sqltx.Do(context.Background(), begin(tx), func(*fakeTx) error { return nil }))
	require.Equal(t, 1, tx.commits)
	require.Zero(t, tx.rollbacks)
}

func TestDo_RollsBackWorkThatFailsAndReturnsItsError(t *testing.T) {
	tx := &fakeTx{}
	boom := errors.New("boom")
	err := sqltx.Do(context.Background(), begin(tx), func(*fakeTx) error { return boom })
	require.Same(t, boom, err)
	require.Zero(t, tx.commits)
	require.Equal(t, 1, tx.rollbacks)
}

func TestDo_RollsBackWorkThatPanics(t *testing.T) {
	tx := &fakeTx{}
	require.PanicsWithValue(t, "bug", func() {
		_ = sqltx.Do(context.Background(), begin(tx), func(*fakeTx) error { panic("bug") })
	})
	require.Zero(t, tx.commits)
	require.Equal(t, 1, tx.rollbacks)
}

// A failed COMMIT is told from a failure of the work, with the COMMIT's own message.
func TestDo_AFailedCommitIsACommitError(t *testing.T) {
	lost := errors.New("connection lost")
	tx := &fakeTx{commitErr: lost}
	err := sqltx.Do(context.Background(), begin(tx), func(*fakeTx) error { return nil })
	var ce *sqltx.CommitError
	require.ErrorAs(t, err, &ce)
	require.ErrorIs(t, err, lost)
	require.Equal(t, "connection lost", err.Error())
	require.Zero(t, tx.rollbacks)
}
