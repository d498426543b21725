package sqldb_test

import (
	"context"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// connectSecret is the password of the URLs of these tests, which no error may show.
const connectSecret = "Conn3ct-S3cret"

// TestOpen_ServerThatNeverAnswersTimesOut opens a database on a server that accepts the TCP
// connection and never sends a byte: the handshake, not the dial, is what must be bounded.
func TestOpen_ServerThatNeverAnswersTimesOut(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	for _, scheme := range []string{"postgres", "mysql"} {
		t.Run(scheme, func(t *testing.T) {
			t.Parallel()
			addr := testsvc.SilentListener(t)
			rawURL := scheme + "://app:" + connectSecret + "@" + addr + "/orders?connect_timeout=300ms"
			start := time.Now()
			db, err := sqldb.Open(context.Background(), rawURL)
			elapsed := time.Since(start)
			if err == nil {
				_ = db.Close()
			}
			require.Error(t, err)
			t.Log(err)
			require.GreaterOrEqual(t, elapsed, timeout-10*time.Millisecond, "the wait ended before the timeout")
			require.Less(t, elapsed, timeout+2*time.Second, "Open outlived connect_timeout=300ms")
			require.Contains(t, err.Error(), addr, "the error names the host and port")
			require.Contains(t, err.Error(), "no answer within 300ms (connect_timeout)")
			require.NotContains(t, err.Error(), connectSecret)
			require.ErrorIs(t, err, context.DeadlineExceeded)
		})
	}
}

// TestOpen_CallersDeadlineEndsTheConnect gives Open a context that ends before the connect
// timeout: the caller's deadline wins, and the error does not blame connect_timeout.
func TestOpen_CallersDeadlineEndsTheConnect(t *testing.T) {
	t.Parallel()
	addr := testsvc.SilentListener(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := sqldb.Open(ctx, "postgres://app:"+connectSecret+"@"+addr+"/orders")
	require.Error(t, err)
	require.Less(t, time.Since(start), 2*time.Second)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotContains(t, err.Error(), "connect_timeout")
	require.NotContains(t, err.Error(), connectSecret)
}

// TestOpen_LaterConnectsOfThePoolAreBounded opens a database through a proxy that forwards
// the first connection and then stops answering: the pool's next connect, made for a query
// whose context has no deadline, fails within the connect timeout instead of hanging.
func TestOpen_LaterConnectsOfThePoolAreBounded(t *testing.T) {
	t.Parallel()
	for _, s := range servers() {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			u, err := url.Parse(s.url(t))
			require.NoError(t, err)
			proxy := newHangingProxy(t, u.Host)
			u.Host = proxy.addr
			q := u.Query()
			q.Set("connect_timeout", "300ms")
			u.RawQuery = q.Encode()
			db, err := sqldb.Open(context.Background(), u.String())
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			db.SetMaxIdleConns(0) // every query needs a connect of its own

			proxy.hang()
			start := time.Now()
			_, err = db.ExecContext(context.Background(), "SELECT 1")
			require.Error(t, err)
			require.Less(t, time.Since(start), 2*time.Second, "a later connect outlived connect_timeout=300ms")
			require.ErrorIs(t, err, context.DeadlineExceeded)
		})
	}
}

// hangingProxy forwards connections to a server until hang is called; connections accepted
// after that are held open and never answered.
type hangingProxy struct {
	addr    string
	mu      sync.Mutex
	hanging bool
}

func newHangingProxy(t testing.TB, target string) *hangingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &hangingProxy{addr: ln.Addr().String()}
	var conns []net.Conn
	var connsMu sync.Mutex
	track := func(c net.Conn) {
		connsMu.Lock()
		conns = append(conns, c)
		connsMu.Unlock()
	}
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			track(client)
			p.mu.Lock()
			hanging := p.hanging
			p.mu.Unlock()
			if hanging {
				continue
			}
			srv, err := net.Dial("tcp", target)
			if err != nil {
				_ = client.Close()
				continue
			}
			track(srv)
			go pipe(srv, client)
			go pipe(client, srv)
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		connsMu.Lock()
		defer connsMu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return p
}

func (p *hangingProxy) hang() {
	p.mu.Lock()
	p.hanging = true
	p.mu.Unlock()
}

func pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	_ = dst.Close()
	_ = src.Close()
}

func TestParseURL_ConnectTimeout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in, dsn string
		want    time.Duration
	}{
		{"postgres://app@db.internal/orders?sslmode=disable", "postgres://app@db.internal/orders?sslmode=disable", sqldb.DefaultConnectTimeout},
		{"postgres://app@db.internal/orders?sslmode=disable&connect_timeout=300ms&application_name=a%20b",
			"postgres://app@db.internal/orders?sslmode=disable&application_name=a%20b", 300 * time.Millisecond},
		{"postgres://app@db.internal/orders?connect_timeout=5", "postgres://app@db.internal/orders", 5 * time.Second},
		{"postgres://app@db.internal/orders?connect_timeout=0", "postgres://app@db.internal/orders", 0},
		{"postgres://app@db.internal/orders?connect_timeout=1s&connect_timeout=2s", "postgres://app@db.internal/orders", 2 * time.Second},
	} {
		t.Run(tc.in, func(t *testing.T) {
			t.Parallel()
			_, dsn, _, _, timeout, err := sqldb.ParseURL(tc.in)
			require.NoError(t, err)
			require.Equal(t, tc.dsn, dsn, "connect_timeout is not passed to pgx")
			require.Equal(t, tc.want, timeout)
		})
	}
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		_, dsn, _, _, timeout, err := sqldb.ParseURL("mysql://app@db.internal/orders?connect_timeout=2s&parseTime=true")
		require.NoError(t, err)
		require.Equal(t, 2*time.Second, timeout)
		require.NotContains(t, dsn, "connect_timeout", "it would become a session variable")
		require.Contains(t, dsn, "parseTime=true")
		_, _, _, _, timeout, err = sqldb.ParseURL("mariadb://app@db.internal/orders")
		require.NoError(t, err)
		require.Equal(t, sqldb.DefaultConnectTimeout, timeout)
	})
	t.Run("sqlite ignores it", func(t *testing.T) {
		t.Parallel()
		_, dsn, _, _, timeout, err := sqldb.ParseURL("sqlite:///tmp/app.db?connect_timeout=1s")
		require.NoError(t, err)
		require.Zero(t, timeout)
		require.False(t, strings.Contains(dsn, "connect_timeout"), dsn)
	})
	for in, want := range map[string]string{
		"postgres://app:" + connectSecret + "@db.internal/orders?connect_timeout=soon": `database URL "postgres://app:xxxxx@db.internal/orders?connect_timeout=soon": query parameter connect_timeout="soon": want a Go duration such as 10s or 300ms, or whole seconds`,
		"mysql://app@db.internal/orders?connect_timeout=-1s":                           `database URL "mysql://app@db.internal/orders?connect_timeout=-1s": query parameter connect_timeout="-1s": want a duration that is not negative (0 waits without limit)`,
	} {
		_, _, _, _, _, err := sqldb.ParseURL(in)
		require.EqualError(t, err, want)
	}
}

func TestDefaultConnectTimeout(t *testing.T) {
	t.Parallel()
	require.Equal(t, 10*time.Second, sqldb.DefaultConnectTimeout)
}
