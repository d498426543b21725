package sqldb_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"modernc.org/sqlite"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// server is a database server dialect with what the tests need to provoke errors on it.
type server struct {
	name string
	// open returns a fresh database through testsvc.
	open func(testing.TB) *sqldb.DB
	// url returns the URL of a fresh database through testsvc.
	url func(testing.TB) string
}

// servers lists the dialects that run as a server: PostgreSQL and MariaDB.
func servers() []server {
	return []server{
		{name: "postgres", open: testsvc.Postgres, url: testsvc.PostgresSchemaURL},
		{name: "mysql", open: testsvc.MySQL, url: testsvc.MySQLDatabaseURL},
	}
}

// code returns the driver's own code of err: a SQLSTATE, a MySQL error number or an SQLite
// extended result code, or "" when err carries none.
func code(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	var myErr *mysql.MySQLError
	if errors.As(err, &myErr) {
		return strconv.Itoa(int(myErr.Number))
	}
	var sqErr *sqlite.Error
	if errors.As(err, &sqErr) {
		return strconv.Itoa(sqErr.Code())
	}
	return ""
}

// chain describes err and everything it wraps, for failure messages.
func chain(err error) string {
	var b bytes.Buffer
	for e := err; e != nil; e = errors.Unwrap(e) {
		fmt.Fprintf(&b, " -> %T(%v)", e, e)
	}
	return b.String()
}

// requireClass asserts the class of err, showing what err is made of when it differs.
func requireClass(t testing.TB, want sqldb.Class, err error) {
	t.Helper()
	require.Error(t, err)
	require.Equal(t, want, sqldb.Classify(err), "Classify(%v); error chain:%s", err, chain(err))
	t.Logf("%s:%s", want, chain(err))
}

func mustExec(t testing.TB, db *sqldb.DB, query string, args ...any) {
	t.Helper()
	_, err := db.ExecContext(context.Background(), db.Rebind(query), args...)
	require.NoError(t, err, query)
}

func count(t testing.TB, db *sqldb.DB, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowxContext(context.Background(), db.Rebind(query), args...).Scan(&n), query)
	return n
}

// queryer is what a session that the tests kill can be: a pinned connection or a transaction.
type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// sessionID returns the server's id of the session q runs on.
func sessionID(t testing.TB, db *sqldb.DB, q queryer) int64 {
	t.Helper()
	query := "SELECT pg_backend_pid()"
	if db.Dialect == sqldb.MySQL {
		query = "SELECT CONNECTION_ID()"
	}
	var id int64
	require.NoError(t, q.QueryRowContext(context.Background(), query).Scan(&id))
	return id
}

// killSession ends session id from another connection of db and waits until the server has
// closed it.
func killSession(t testing.TB, db *sqldb.DB, id int64) {
	t.Helper()
	ctx := context.Background()
	switch db.Dialect {
	case sqldb.Postgres:
		var done bool
		// With a timeout, pg_terminate_backend waits until the session has exited.
		require.NoError(t, db.QueryRowxContext(ctx, "SELECT pg_terminate_backend($1, 10000)", id).Scan(&done))
		require.True(t, done, "session %d did not exit", id)
	case sqldb.MySQL:
		_, err := db.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatInt(id, 10))
		require.NoError(t, err)
		testsvc.Eventually(t, 10*time.Second, func() bool {
			return count(t, db, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?", id) == 0
		}, "MariaDB session %d still listed after KILL", id)
	default:
		t.Fatalf("no sessions to kill on %s", db.Dialect)
	}
}

// sleepSQL returns a statement that runs for seconds on the server of db.
func sleepSQL(db *sqldb.DB, seconds int) string {
	if db.Dialect == sqldb.MySQL {
		return fmt.Sprintf("SELECT SLEEP(%d)", seconds)
	}
	return fmt.Sprintf("SELECT pg_sleep(%d)", seconds)
}

// waitRunning waits until session id is executing a statement that sleepSQL returned.
func waitRunning(t testing.TB, db *sqldb.DB, id int64) {
	t.Helper()
	query := "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ? AND state = 'active' AND wait_event = 'PgSleep'"
	if db.Dialect == sqldb.MySQL {
		query = "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO LIKE 'SELECT SLEEP(%'"
	}
	testsvc.Eventually(t, 10*time.Second, func() bool { return count(t, db, query, id) == 1 },
		"session %d never started its statement", id)
}

// cutMode says what a commitCutter lets through when it cuts a connection.
type cutMode int

const (
	// requestLost drops the COMMIT before the server sees it: the transaction rolls back.
	requestLost cutMode = iota
	// replyLost delivers the COMMIT and drops the server's answer: the transaction commits.
	replyLost
)

func (m cutMode) String() string {
	if m == replyLost {
		return "reply lost"
	}
	return "request lost"
}

// commitCutter is a TCP proxy on loopback between database clients and a server. Once armed,
// it cuts the client connection whose next packet carries COMMIT, so that the client sees its
// connection die with the COMMIT in flight. In mode replyLost the COMMIT reaches the server
// before the cut, and the server's answer is swallowed.
type commitCutter struct {
	ln     net.Listener
	target string
	mode   cutMode
	armed  atomic.Bool
	// cut is closed when a connection was cut.
	cut chan struct{}
	// answered is closed, in mode replyLost, when the server has answered the COMMIT that
	// the client never hears about.
	answered chan struct{}

	mu    sync.Mutex
	conns []net.Conn
}

func newCommitCutter(t testing.TB, target string, mode cutMode) *commitCutter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &commitCutter{ln: ln, target: target, mode: mode, cut: make(chan struct{}), answered: make(chan struct{})}
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

// Addr returns the host:port clients connect to.
func (p *commitCutter) Addr() string { return p.ln.Addr().String() }

// Arm makes the proxy cut the next connection that sends COMMIT.
func (p *commitCutter) Arm() { p.armed.Store(true) }

func (p *commitCutter) track(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

func (p *commitCutter) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.serve(client)
	}
}

func (p *commitCutter) serve(client net.Conn) {
	p.track(client)
	srv, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	p.track(srv)
	var cut atomic.Bool
	go func() { // server to client
		defer srv.Close()
		defer client.Close()
		buf := make([]byte, 64<<10)
		for {
			n, err := srv.Read(buf)
			if n > 0 {
				if cut.Load() {
					close(p.answered)
					return
				}
				if _, err := client.Write(buf[:n]); err != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := client.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			if bytes.Contains(bytes.ToLower(chunk), []byte("commit")) && p.armed.CompareAndSwap(true, false) {
				cut.Store(true)
				if p.mode == replyLost {
					_, _ = srv.Write(chunk)
				} else {
					_ = srv.Close()
				}
				_ = client.Close()
				close(p.cut)
				return
			}
			if _, err := srv.Write(chunk); err != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	_ = srv.Close()
	_ = client.Close()
}

// closedPort returns a loopback address on which nothing listens.
func closedPort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}
