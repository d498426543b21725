package sqllock_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/sqllock"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

func TestTryLock_OneHolderAtATimeAcrossPools(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			url := d.URL(t)
			open := func() *sqldb.DB { // a pool of its own, as another process has
				db, err := sqldb.Open(ctx, url)
				require.NoError(t, err)
				t.Cleanup(func() { _ = db.Close() })
				return db
			}
			a, b := open(), open()

			release, held, err := sqllock.TryLock(ctx, a, "sweep.x")
			require.NoError(t, err)
			require.True(t, held)
			_, held, err = sqllock.TryLock(ctx, b, "sweep.x")
			require.NoError(t, err)
			require.False(t, held, "another session holds it")
			other, held, err := sqllock.TryLock(ctx, b, "sweep.y")
			require.NoError(t, err)
			require.True(t, held, "another name is another lock")
			require.NoError(t, other())

			require.NoError(t, release())
			release, held, err = sqllock.TryLock(ctx, b, "sweep.x")
			require.NoError(t, err)
			require.True(t, held, "released")
			require.NoError(t, release())
		})
	}
}

func TestTryLock_RefusesAPathAsName(t *testing.T) {
	t.Parallel()
	_, _, err := sqllock.TryLock(context.Background(), testsvc.SQLite(t), "../x")
	require.Error(t, err)
}
