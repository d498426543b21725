package sqlqueue_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/tcpproxy"
)

// tcpProxy is a loopback TCP proxy in front of the test's database server, to cut its
// connections.
type tcpProxy struct {
	proxy *tcpproxy.Proxy
	// url is the database URL with the proxy's address in place of the server's.
	url string
}

// proxy starts a proxy in front of the env's server, stopped when the test ends.
func (e *env) proxy() *tcpProxy {
	e.t.Helper()
	p, via, err := tcpproxy.ForURL(e.url)
	require.NoError(e.t, err)
	e.t.Cleanup(p.Close)
	return &tcpProxy{proxy: p, url: via}
}

// cut closes every connection through the proxy and refuses new ones until restore.
func (p *tcpProxy) cut() { p.proxy.Cut() }

// restore accepts connections again, on the same address.
func (p *tcpProxy) restore(t testing.TB) {
	t.Helper()
	require.NoError(t, p.proxy.Restore())
}
