package tcpproxy

import (
	"bufio"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const within = 5 * time.Second

// echo starts a loopback server that writes back each line it reads, and returns its address.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().String()
}

func startProxy(t *testing.T, upstream string) *Proxy {
	t.Helper()
	p, err := Start(upstream)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

// connect opens a connection through p, closed when the test ends.
func connect(t *testing.T, p *Proxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip writes line on c and returns what comes back before the deadline.
func roundTrip(t *testing.T, c net.Conn, line string) (string, error) {
	t.Helper()
	require.NoError(t, c.SetDeadline(time.Now().Add(within)))
	if _, err := c.Write([]byte(line + "\n")); err != nil {
		return "", err
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	return got, err
}

func TestProxy_ForwardsBothWays(t *testing.T) {
	p := startProxy(t, echo(t))
	c := connect(t, p)
	got, err := roundTrip(t, c, "hello")
	require.NoError(t, err)
	require.Equal(t, "hello\n", got)
}

func TestProxy_CutClosesEveryConnectionAndRefusesNewOnesUntilRestore(t *testing.T) {
	p := startProxy(t, echo(t))
	open := make([]net.Conn, 3)
	for i := range open {
		c := connect(t, p)
		_, err := roundTrip(t, c, "before")
		require.NoError(t, err)
		open[i] = c
	}

	p.Cut()
	for i, c := range open {
		_, err := roundTrip(t, c, "during")
		require.Error(t, err, "connection %d still carries bytes after the cut", i)
	}
	_, err := net.DialTimeout("tcp", p.Addr(), within)
	require.Error(t, err, "the proxy accepted a connection while cut")

	require.NoError(t, p.Restore())
	c := connect(t, p)
	got, err := roundTrip(t, c, "after")
	require.NoError(t, err)
	require.Equal(t, "after\n", got)
}

func TestProxy_AnUpstreamDialThatHangsDoesNotStopTheNextConnection(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	var calls atomic.Int32
	p, err := start(echo(t), func(network, address string, timeout time.Duration) (net.Conn, error) {
		if calls.Add(1) == 1 {
			<-release
			return nil, io.ErrUnexpectedEOF
		}
		return net.DialTimeout(network, address, timeout)
	})
	require.NoError(t, err)
	t.Cleanup(p.Close)

	connect(t, p) // its dial hangs
	// Wait until the first connection's dial has begun, so the second one dials second.
	deadline := time.Now().Add(within)
	for {
		if calls.Load() == 1 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the proxy never took the first connection")
		time.Sleep(time.Millisecond)
	}

	c := connect(t, p)
	got, err := roundTrip(t, c, "next")
	require.NoError(t, err)
	require.Equal(t, "next\n", got)
}

func TestProxy_BlackholeKeepsConnectionsOpenAndSilent(t *testing.T) {
	p := startProxy(t, echo(t))
	c := connect(t, p)
	_, err := roundTrip(t, c, "before")
	require.NoError(t, err)

	p.Blackhole()
	require.NoError(t, c.SetDeadline(time.Now().Add(200*time.Millisecond)))
	_, err = c.Write([]byte("swallowed\n"))
	require.NoError(t, err)
	_, err = c.Read(make([]byte, 1))
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout(), "want a timeout from a silent connection, got %v", err)
}

func TestForURL_PutsTheProxyInTheURLAndDefaultsThePort(t *testing.T) {
	p, u, err := ForURL("postgres://postgres@localhost/test?sslmode=disable")
	require.NoError(t, err)
	defer p.Close()
	require.Equal(t, "localhost:5432", p.upstream)
	require.Equal(t, "postgres://postgres@"+p.Addr()+"/test?sslmode=disable", u)

	_, _, err = ForURL("unknown://host/x")
	require.ErrorContains(t, err, `scheme "unknown" has no known default`)
}
