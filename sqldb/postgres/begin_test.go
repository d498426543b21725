package postgres_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"net"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb/postgres"
)

// countingConn counts the writes to the server, one per round trip.
type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(b []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(b)
}

// wrappedConnector gives pgx's connections wrapped by the driver's WrapConn, as sqldb.Open does.
type wrappedConnector struct{ driver.Connector }

func (c wrappedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	dc, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return postgres.WrapConn(dc), nil
}

// openCounted opens a pool of one connection to the test server whose writes are counted,
// with each connection wrapped by the driver's WrapConn, or pgx's driver alone when lazy is false.
func openCounted(t testing.TB, lazy bool) (*sql.DB, *atomic.Int64) {
	t.Helper()
	cfg, err := pgx.ParseConfig(testsvc.PostgresURL(t))
	require.NoError(t, err)
	writes := new(atomic.Int64)
	dial := cfg.DialFunc
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countingConn{Conn: c, writes: writes}, nil
	}
	var connector driver.Connector = stdlib.GetConnector(*cfg)
	if lazy {
		connector = wrappedConnector{connector}
	}
	db := sql.OpenDB(connector)
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { _ = db.Close() })
	table := testsvc.UniqueName("begin")
	_, err = db.Exec(`CREATE TEMPORARY TABLE ` + table + ` (id INT PRIMARY KEY)`)
	require.NoError(t, err)
	_, err = db.Exec(`CREATE TEMPORARY VIEW begin_t AS SELECT * FROM ` + table)
	require.NoError(t, err)
	return db, writes
}

// roundTrips returns the writes that f makes, after one run of f that prepares its
// statements.
func roundTrips(t *testing.T, writes *atomic.Int64, f func()) int64 {
	t.Helper()
	f()
	before := writes.Load()
	f()
	return writes.Load() - before
}

func TestBegin_GoesWithTheFirstExec(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	id := 0
	insertAndCommit := func(db *sql.DB) func() {
		return func() {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			id++
			_, err = tx.ExecContext(ctx, `INSERT INTO begin_t VALUES ($1)`, id)
			require.NoError(t, err)
			require.NoError(t, tx.Commit())
		}
	}
	lazy, lazyWrites := openCounted(t, true)
	plain, plainWrites := openCounted(t, false)
	require.EqualValues(t, 2, roundTrips(t, lazyWrites, insertAndCommit(lazy)), "BEGIN and INSERT, COMMIT")
	require.EqualValues(t, 3, roundTrips(t, plainWrites, insertAndCommit(plain)), "pgx's driver: BEGIN, INSERT, COMMIT")

	var n int
	require.NoError(t, lazy.QueryRowContext(ctx, `SELECT count(*) FROM begin_t`).Scan(&n))
	require.Equal(t, 2, n, "both transactions committed")
}

func TestBegin_ATransactionWithoutStatementsCostsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, writes := openCounted(t, true)
	empty := func(commit bool) func() {
		return func() {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			if commit {
				require.NoError(t, tx.Commit())
			} else {
				require.NoError(t, tx.Rollback())
			}
		}
	}
	require.Zero(t, roundTrips(t, writes, empty(true)))
	require.Zero(t, roundTrips(t, writes, empty(false)))
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.Raw(func(dc any) error {
		require.Equal(t, byte('I'), dc.(interface{ Conn() *pgx.Conn }).Conn().PgConn().TxStatus(), "the connection is in no transaction")
		return nil
	}))
}

func TestBegin_RollbackUndoesTheFirstExec(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := openCounted(t, true)
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO begin_t VALUES (1)`)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback())
	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM begin_t`).Scan(&n))
	require.Zero(t, n)
}

func TestBegin_AFailedFirstExecRollsTheTransactionBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := openCounted(t, true)
	_, err := db.ExecContext(ctx, `INSERT INTO begin_t VALUES (1)`)
	require.NoError(t, err)

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO begin_t VALUES (1)`)
	require.Equal(t, "23505", code(err), "unique violation: %v", err)
	_, err = tx.ExecContext(ctx, `INSERT INTO begin_t VALUES (2)`)
	require.Equal(t, "25P02", code(err), "the transaction is aborted: %v", err)
	require.ErrorIs(t, tx.Commit(), pgx.ErrTxCommitRollback)

	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM begin_t`).Scan(&n))
	require.Equal(t, 1, n)
}

func TestBegin_AFirstExecTheServerCannotPrepareFailsTheTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := openCounted(t, true)
	for _, end := range []string{"commit", "rollback"} {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, `INSERT INTO no_such_table VALUES (1)`)
		require.Equal(t, "42P01", code(err), "undefined table: %v", err)
		_, err = tx.ExecContext(ctx, `INSERT INTO begin_t VALUES (1)`)
		require.Equal(t, "25P02", code(err), "the transaction is failed, as on the server: %v", err)
		var one int
		require.Equal(t, "25P02", code(tx.QueryRowContext(ctx, `SELECT 1`).Scan(&one)))
		if end == "commit" {
			require.ErrorIs(t, tx.Commit(), pgx.ErrTxCommitRollback)
		} else {
			require.NoError(t, tx.Rollback())
		}
	}
	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM begin_t`).Scan(&n))
	require.Zero(t, n, "nothing ran outside a transaction")

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO begin_t VALUES (2)`)
	require.NoError(t, err, "the next transaction is a good one")
	require.NoError(t, tx.Commit())
}

func TestBegin_KeepsTheTransactionsOptions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := openCounted(t, true)
	for _, tc := range []struct {
		opts      *sql.TxOptions
		isolation string
		readOnly  string
	}{
		{nil, "read committed", "off"},
		{&sql.TxOptions{Isolation: sql.LevelRepeatableRead}, "repeatable read", "off"},
		{&sql.TxOptions{Isolation: sql.LevelSerializable, ReadOnly: true}, "serializable", "on"},
	} {
		for _, first := range []string{"exec", "query"} {
			tx, err := db.BeginTx(ctx, tc.opts)
			require.NoError(t, err)
			if first == "exec" {
				_, err = tx.ExecContext(ctx, `SELECT 1`)
				require.NoError(t, err)
			}
			var isolation, readOnly string
			require.NoError(t, tx.QueryRowContext(ctx, `SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')`).Scan(&isolation, &readOnly))
			require.Equal(t, tc.isolation, isolation, "%+v, %s first", tc.opts, first)
			require.Equal(t, tc.readOnly, readOnly, "%+v, %s first", tc.opts, first)
			require.NoError(t, tx.Commit())
		}
	}
	_, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelLinearizable})
	require.ErrorContains(t, err, "unsupported isolation", "pgx's driver refuses what it does not know")
}

func TestBegin_APreparedStatementRunsInTheTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := openCounted(t, true)
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	stmt, err := tx.PrepareContext(ctx, `INSERT INTO begin_t VALUES ($1)`)
	require.NoError(t, err)
	_, err = stmt.ExecContext(ctx, 7)
	require.NoError(t, err)
	require.NoError(t, stmt.Close())
	require.NoError(t, tx.Rollback())
	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM begin_t`).Scan(&n))
	require.Zero(t, n, "the rollback undid the prepared statement's insert")
}

func TestBegin_AStatementPreparedOnThePoolRunsInALaterTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := openCounted(t, true)
	insert, err := db.PrepareContext(ctx, `INSERT INTO begin_t VALUES ($1)`)
	require.NoError(t, err)
	defer insert.Close()
	_, err = insert.ExecContext(ctx, 1) // prepared on the pool's one connection
	require.NoError(t, err)

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.StmtContext(ctx, insert).ExecContext(ctx, 2) // the same prepared statement
	require.NoError(t, err)
	require.NoError(t, tx.Rollback())

	var ids []int
	rows, err := db.QueryContext(ctx, `SELECT id FROM begin_t ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var id int
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []int{1}, ids, "the rollback undid the insert run in the transaction")
}

// BenchmarkTransaction is a transaction of one insert, on pgx's driver and with its BEGIN sent
// with the insert: the round trip saved is the difference.
func BenchmarkTransaction(b *testing.B) {
	for _, lazy := range []bool{false, true} {
		name := "pgx"
		if lazy {
			name = "begin-with-first-exec"
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			db, _ := openCounted(b, lazy)
			_, err := db.Exec(`CREATE TEMPORARY SEQUENCE begin_seq`)
			require.NoError(b, err)
			for b.Loop() {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := tx.ExecContext(ctx, `INSERT INTO begin_t VALUES (nextval('begin_seq'))`); err != nil {
					b.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
