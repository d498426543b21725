package sqldb_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

func TestClass_String(t *testing.T) {
	t.Parallel()
	for c, want := range map[sqldb.Class]string{
		sqldb.Unknown:         "unknown",
		sqldb.UniqueViolation: "unique violation",
		sqldb.Conflict:        "conflict",
		sqldb.Connection:      "connection",
		sqldb.Data:            "data",
		sqldb.ReadOnly:        "read-only",
		sqldb.Class(99):       "unknown",
	} {
		require.Equal(t, want, c.String())
	}
}

func TestClassify_NilIsUnknown(t *testing.T) {
	t.Parallel()
	require.Equal(t, sqldb.Unknown, sqldb.Classify(nil))
	require.False(t, sqldb.IsRetryable(nil))
	require.False(t, sqldb.IsUniqueViolation(nil))
}

// TestClassify_ConstructedErrors covers the driver-independent error values; the drivers'
// packages cover their own codes.
func TestClassify_ConstructedErrors(t *testing.T) {
	t.Parallel()
	netErr := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	for _, tc := range []struct {
		name string
		err  error
		want sqldb.Class
	}{
		{"database/sql bad connection", driver.ErrBadConn, sqldb.Connection},
		{"EOF", io.EOF, sqldb.Connection},
		{"unexpected EOF", io.ErrUnexpectedEOF, sqldb.Connection},
		{"connection reset", netErr, sqldb.Connection},
		{"connection refused", syscall.ECONNREFUSED, sqldb.Connection},
		{"broken pipe", syscall.EPIPE, sqldb.Connection},
		{"closed network connection", net.ErrClosed, sqldb.Connection},
		{"context canceled", context.Canceled, sqldb.Unknown},
		{"context deadline", context.DeadlineExceeded, sqldb.Unknown},
		{"context canceled wrapped with a network error", fmt.Errorf("%w: %w", context.Canceled, netErr), sqldb.Unknown},
		{"no rows", sql.ErrNoRows, sqldb.Unknown},
		{"tx done", sql.ErrTxDone, sqldb.Unknown},
		{"plain", errors.New("boom"), sqldb.Unknown},
		{"wrapped twice", fmt.Errorf("a: %w", fmt.Errorf("b: %w", io.EOF)), sqldb.Connection},
		{"joined", errors.Join(errors.New("rollback: tx done"), driver.ErrBadConn), sqldb.Connection},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			requireClass(t, tc.want, tc.err)
		})
	}
}

func TestIsRetryable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{driver.ErrBadConn, true},
		{errors.New("unknown"), true},
		{context.Canceled, true},
		{nil, false},
	} {
		require.Equal(t, tc.want, sqldb.IsRetryable(tc.err), "IsRetryable(%v)", tc.err)
	}
}

func TestClassify_InsertTwiceIsUniqueViolation(t *testing.T) {
	t.Parallel()
	want := map[string]string{"sqlite": "1555", "postgres": "23505", "mysql": "1062"}
	wantUnique := map[string]string{"sqlite": "2067", "postgres": "23505", "mysql": "1062"}
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			mustExec(t, db, "CREATE TABLE message_log (id VARCHAR(64) PRIMARY KEY, k VARCHAR(64) NOT NULL UNIQUE)")
			mustExec(t, db, "INSERT INTO message_log (id, k) VALUES (?, ?)", "m1", "k1")

			_, err := db.ExecContext(context.Background(), db.Rebind("INSERT INTO message_log (id, k) VALUES (?, ?)"), "m1", "k2")
			requireClass(t, sqldb.UniqueViolation, err)
			require.Equal(t, want[d.Name], code(err))
			require.True(t, sqldb.IsUniqueViolation(err))
			require.False(t, sqldb.IsRetryable(err))

			_, err = db.ExecContext(context.Background(), db.Rebind("INSERT INTO message_log (id, k) VALUES (?, ?)"), "m2", "k1")
			requireClass(t, sqldb.UniqueViolation, err)
			require.Equal(t, wantUnique[d.Name], code(err))

			// Wrapping keeps the class.
			requireClass(t, sqldb.UniqueViolation, fmt.Errorf("record message m1: %w", err))
			requireClass(t, sqldb.UniqueViolation, fmt.Errorf("handler: %w", fmt.Errorf("dedup: %w", err)))
			requireClass(t, sqldb.UniqueViolation, errors.Join(err, errors.New("rollback: sql: transaction has already been committed or rolled back")))
		})
	}
}

func TestClassify_DataErrorsAreData(t *testing.T) {
	t.Parallel()
	type dataCase struct {
		name  string
		stmt  string
		codes map[string]string // by dialect; a dialect without an entry does not reject stmt
	}
	cases := []dataCase{
		{"NOT NULL violation", "INSERT INTO item (id, name, qty, parent_id) VALUES (1, NULL, 1, NULL)",
			map[string]string{"sqlite": "1299", "postgres": "23502", "mysql": "1048"}},
		{"value too long", "INSERT INTO item (id, name, qty, parent_id) VALUES (2, 'abcd', 1, NULL)",
			map[string]string{"postgres": "22001", "mysql": "1406"}},
		{"check violation", "INSERT INTO item (id, name, qty, parent_id) VALUES (3, 'abc', -1, NULL)",
			map[string]string{"sqlite": "275", "postgres": "23514", "mysql": "4025"}},
		{"foreign key violation", "INSERT INTO item (id, name, qty, parent_id) VALUES (4, 'abc', 1, 99)",
			map[string]string{"sqlite": "787", "postgres": "23503", "mysql": "1452"}},
		{"malformed number", "INSERT INTO item (id, name, qty, parent_id) VALUES (5, 'abc', 'many', NULL)",
			map[string]string{"postgres": "22P02", "mysql": "1366"}},
		{"number out of range", "INSERT INTO item (id, name, qty, parent_id) VALUES (6, 'abc', 99999999999, NULL)",
			map[string]string{"postgres": "22003", "mysql": "1264"}},
		{"wrong type in a STRICT table", "INSERT INTO strict_item (id, qty) VALUES (7, 'many')",
			map[string]string{"sqlite": "3091"}},
	}
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			ctx := context.Background()
			conn, err := db.Connx(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = conn.Close() })
			setup := []string{
				"CREATE TABLE parent (id INT PRIMARY KEY)",
				"CREATE TABLE item (id INT PRIMARY KEY, name VARCHAR(3) NOT NULL, qty INT NOT NULL CHECK (qty >= 0), parent_id INT, FOREIGN KEY (parent_id) REFERENCES parent (id))",
			}
			switch db.Dialect {
			case sqldb.MySQL:
				setup = append([]string{"SET SESSION sql_mode = 'STRICT_ALL_TABLES'"}, setup...)
			case sqldb.SQLite:
				setup = append(setup, "CREATE TABLE strict_item (id INTEGER PRIMARY KEY, qty INTEGER NOT NULL) STRICT")
			}
			for _, s := range setup {
				_, err := conn.ExecContext(ctx, s)
				require.NoError(t, err, s)
			}
			for _, tc := range cases {
				want, rejects := tc.codes[d.Name]
				if !rejects {
					continue
				}
				t.Run(tc.name, func(t *testing.T) {
					_, err := conn.ExecContext(ctx, tc.stmt)
					requireClass(t, sqldb.Data, err)
					require.Equal(t, want, code(err))
					require.False(t, sqldb.IsRetryable(err))
				})
			}
		})
	}
}

func TestClassify_DeadlockIsConflict(t *testing.T) {
	t.Parallel()
	want := map[string]string{"postgres": "40P01", "mysql": "1213"}
	for _, s := range servers() {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			db := s.open(t)
			ctx := context.Background()
			mustExec(t, db, "CREATE TABLE account (id INT PRIMARY KEY, balance INT NOT NULL)")
			mustExec(t, db, "INSERT INTO account (id, balance) VALUES (1, 0), (2, 0)")

			begin := func() *sql.Tx {
				tx, err := db.BeginTx(ctx, nil)
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback() })
				if db.Dialect == sqldb.Postgres {
					// Check for deadlocks after 20 ms of waiting instead of the default second.
					_, err := tx.ExecContext(ctx, "SET LOCAL deadlock_timeout = '20ms'")
					require.NoError(t, err)
				}
				return tx
			}
			update := db.Rebind("UPDATE account SET balance = balance + 1 WHERE id = ?")
			tx1, tx2 := begin(), begin()
			// Each transaction locks one row; both hold their lock before either reaches for the other's.
			_, err := tx1.ExecContext(ctx, update, 1)
			require.NoError(t, err)
			_, err = tx2.ExecContext(ctx, update, 2)
			require.NoError(t, err)

			errs := make(chan error, 2)
			go func() { _, err := tx1.ExecContext(ctx, update, 2); errs <- err }()
			go func() { _, err := tx2.ExecContext(ctx, update, 1); errs <- err }()
			// The server picks one victim and rolls it back, which lets the other through.
			err1, err2 := <-errs, <-errs
			victim := err1
			if victim == nil {
				victim = err2
			} else {
				require.NoError(t, err2, "both transactions failed")
			}
			requireClass(t, sqldb.Conflict, victim)
			require.Equal(t, want[s.name], code(victim))
			require.True(t, sqldb.IsRetryable(victim))
		})
	}
}

func TestClassify_LockWaitTimeoutIsConflict(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		open   func(testing.TB) *sqldb.DB
		prefix []string // statements that set the wait limit in the waiting transaction
		stmt   string
		code   string
	}{
		{"postgres lock_timeout", testsvc.Postgres, []string{"SET LOCAL lock_timeout = '10ms'"},
			"UPDATE job SET state = 'b' WHERE id = 1", "55P03"},
		{"postgres NOWAIT", testsvc.Postgres, nil,
			"SELECT state FROM job WHERE id = 1 FOR UPDATE NOWAIT", "55P03"},
		{"mysql innodb_lock_wait_timeout", testsvc.MySQL, []string{"SET SESSION innodb_lock_wait_timeout = 1"},
			"UPDATE job SET state = 'b' WHERE id = 1", "1205"},
		{"mysql NOWAIT", testsvc.MySQL, nil,
			"SELECT state FROM job WHERE id = 1 FOR UPDATE NOWAIT", "1205"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := tc.open(t)
			ctx := context.Background()
			mustExec(t, db, "CREATE TABLE job (id INT PRIMARY KEY, state VARCHAR(8) NOT NULL)")
			mustExec(t, db, "INSERT INTO job (id, state) VALUES (1, 'a')")

			holder, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = holder.Rollback() })
			_, err = holder.ExecContext(ctx, "UPDATE job SET state = 'h' WHERE id = 1")
			require.NoError(t, err)

			waiter, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = waiter.Rollback() })
			for _, s := range tc.prefix {
				_, err := waiter.ExecContext(ctx, s)
				require.NoError(t, err, s)
			}
			_, err = waiter.ExecContext(ctx, tc.stmt)
			requireClass(t, sqldb.Conflict, err)
			require.Equal(t, tc.code, code(err))
		})
	}
}

func TestClassify_StatementTimeoutIsConflict(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		open func(testing.TB) *sqldb.DB
		stmt string
		code string
	}{
		{"postgres statement_timeout", testsvc.Postgres, "SET statement_timeout = '10ms'; SELECT pg_sleep(5)", "57014"},
		{"mariadb max_statement_time", testsvc.MySQL, "SET STATEMENT max_statement_time = 0.01 FOR SELECT * FROM information_schema.COLUMNS a, information_schema.COLUMNS b, information_schema.COLUMNS c", "1969"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := tc.open(t)
			_, err := db.ExecContext(context.Background(), tc.stmt)
			requireClass(t, sqldb.Conflict, err)
			require.Equal(t, tc.code, code(err))
		})
	}
}

func TestClassify_KilledSessionIsConnection(t *testing.T) {
	t.Parallel()
	for _, s := range servers() {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			db := s.open(t)
			ctx := context.Background()
			mustExec(t, db, "CREATE TABLE seen (id INT PRIMARY KEY)")

			t.Run("idle, then used", func(t *testing.T) {
				conn, err := db.Conn(ctx)
				require.NoError(t, err)
				t.Cleanup(func() { _ = conn.Close() })
				killSession(t, db, sessionID(t, db, conn))

				_, err = conn.ExecContext(ctx, "INSERT INTO seen (id) VALUES (1)")
				requireClass(t, sqldb.Connection, err)
				require.True(t, sqldb.IsRetryable(err))
				_, err = conn.ExecContext(ctx, "INSERT INTO seen (id) VALUES (1)")
				requireClass(t, sqldb.Connection, err) // database/sql's driver.ErrBadConn from now on
			})

			t.Run("while a statement runs", func(t *testing.T) {
				conn, err := db.Conn(ctx)
				require.NoError(t, err)
				t.Cleanup(func() { _ = conn.Close() })
				id := sessionID(t, db, conn)
				errc := make(chan error, 1)
				go func() { _, err := conn.ExecContext(ctx, sleepSQL(db, 30)); errc <- err }()
				waitRunning(t, db, id)
				killSession(t, db, id)
				requireClass(t, sqldb.Connection, <-errc)
			})

			t.Run("in a transaction, then committed", func(t *testing.T) {
				tx, err := db.BeginTxx(ctx, nil)
				require.NoError(t, err)
				_, err = tx.ExecContext(ctx, "INSERT INTO seen (id) VALUES (2)")
				require.NoError(t, err)
				killSession(t, db, sessionID(t, db, tx))

				err = tx.Commit()
				requireClass(t, sqldb.Connection, err)
				require.Equal(t, 0, count(t, db, "SELECT COUNT(*) FROM seen WHERE id = 2"))
			})
		})
	}
}

// TestClassify_ConnectionLostDuringCommitIsConnection cuts the connection while COMMIT is in
// flight. The client cannot tell whether the transaction committed: the error must be a
// Connection error in both cases, which is what tells the caller the outcome is unknown.
func TestClassify_ConnectionLostDuringCommitIsConnection(t *testing.T) {
	t.Parallel()
	for _, s := range servers() {
		for _, mode := range []cutMode{requestLost, replyLost} {
			t.Run(s.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				rawURL := s.url(t)
				direct, err := sqldb.Open(ctx, rawURL)
				require.NoError(t, err)
				t.Cleanup(func() { _ = direct.Close() })
				mustExec(t, direct, "CREATE TABLE processed (id INT PRIMARY KEY)")

				u, err := url.Parse(rawURL)
				require.NoError(t, err)
				proxy := newCommitCutter(t, u.Host, mode)
				u.Host = proxy.Addr()
				db, err := sqldb.Open(ctx, u.String())
				require.NoError(t, err)
				t.Cleanup(func() { _ = db.Close() })

				tx, err := db.BeginTxx(ctx, nil)
				require.NoError(t, err)
				_, err = tx.ExecContext(ctx, "INSERT INTO processed (id) VALUES (1)")
				require.NoError(t, err)
				proxy.Arm()
				err = tx.Commit()
				<-proxy.cut
				requireClass(t, sqldb.Connection, err)

				want := 0
				if mode == replyLost {
					select {
					case <-proxy.answered:
					case <-time.After(10 * time.Second):
						t.Fatal("the server never answered the COMMIT")
					}
					want = 1
				}
				require.Equal(t, want, count(t, direct, "SELECT COUNT(*) FROM processed"))
			})
		}
	}
}

func TestClassify_RefusedConnectionIsConnection(t *testing.T) {
	t.Parallel()
	for _, scheme := range []string{"postgres", "mysql"} {
		t.Run(scheme, func(t *testing.T) {
			t.Parallel()
			_, err := sqldb.Open(context.Background(), scheme+"://u@"+closedPort(t)+"/db?connect_timeout=5")
			requireClass(t, sqldb.Connection, err)
			require.ErrorIs(t, err, syscall.ECONNREFUSED)
		})
	}
}

func TestClassify_CanceledContextIsNotConnection(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)

			t.Run("canceled before the call", func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				_, err := db.ExecContext(ctx, "SELECT 1")
				require.ErrorIs(t, err, context.Canceled)
				requireClass(t, sqldb.Unknown, err)
			})
			if db.Dialect == sqldb.SQLite {
				t.Run("deadline while waiting for the write lock", func(t *testing.T) {
					holder, err := db.BeginTxx(context.Background(), nil)
					require.NoError(t, err)
					defer func() { _ = holder.Rollback() }()
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
					defer cancel()
					_, err = db.BeginTxx(ctx, nil)
					require.ErrorIs(t, err, context.DeadlineExceeded)
					requireClass(t, sqldb.Unknown, err)
				})
				return
			}
			t.Run("canceled while a statement runs", func(t *testing.T) {
				conn, err := db.Conn(context.Background())
				require.NoError(t, err)
				defer func() { _ = conn.Close() }()
				id := sessionID(t, db, conn)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				errc := make(chan error, 1)
				go func() { _, err := conn.ExecContext(ctx, sleepSQL(db, 30)); errc <- err }()
				waitRunning(t, db, id)
				cancel()
				err = <-errc
				require.ErrorIs(t, err, context.Canceled)
				requireClass(t, sqldb.Unknown, err)
			})
			t.Run("deadline while a statement runs", func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				_, err := db.ExecContext(ctx, sleepSQL(db, 30))
				require.ErrorIs(t, err, context.DeadlineExceeded)
				requireClass(t, sqldb.Unknown, err)
			})
		})
	}
}

func TestIsOutage_ConstructedErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", fmt.Errorf("begin transaction: %w", syscall.ECONNREFUSED), true},
		{"bad connection", driver.ErrBadConn, true},
		{"an error that says so", fmt.Errorf("publish: %w", outage{}), true},
		{"an error that says it is not", outage{not: true}, false},
		{"joined with an outage", errors.Join(errors.New("boom"), io.EOF), true},
		{"context canceled", context.Canceled, false},
		{"plain", errors.New("boom"), false},
		{"nil", nil, false},
	} {
		require.Equal(t, tc.want, sqldb.IsOutage(tc.err), tc.name)
	}
}

type outage struct{ not bool }

func (o outage) Error() string { return "the broker is down" }
func (o outage) Outage() bool  { return !o.not }

func TestClassify_WriteInReadOnlyTransactionIsReadOnly(t *testing.T) {
	t.Parallel()
	want := map[string]string{"postgres": "25006", "mysql": "1792"}
	for _, s := range servers() {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			db := s.open(t)
			ctx := context.Background()
			mustExec(t, db, "CREATE TABLE ro_item (id INT PRIMARY KEY)")
			tx, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback() })
			_, err = tx.ExecContext(ctx, "INSERT INTO ro_item (id) VALUES (1)")
			requireClass(t, sqldb.ReadOnly, err)
			require.Equal(t, want[s.name], code(err))
			require.True(t, sqldb.IsOutage(err))
			require.True(t, sqldb.IsRetryable(err))
		})
	}
}

func TestProbe_AnswersUntilTheDatabaseIsGone(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			require.NoError(t, sqldb.Probe(context.Background(), db))
			require.NoError(t, db.Close())
			require.Error(t, sqldb.Probe(context.Background(), db))
		})
	}
}

func TestProbe_UnreachableServerIsAnOutage(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close()) // nothing listens there now: connects are refused
	db, err := sqldb.Open(context.Background(), "postgres://postgres@"+addr+"/test?sslmode=disable&connect_timeout=1s")
	if err == nil {
		t.Cleanup(func() { _ = db.Close() })
		err = sqldb.Probe(context.Background(), db)
	}
	require.Error(t, err)
	require.True(t, sqldb.IsOutage(err), "IsOutage(%v); error chain:%s", err, chain(err))
}
