package conformance

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/tcpproxy"
)

// tcpProxy is a loopback TCP proxy in front of a service.
type tcpProxy struct {
	proxy *tcpproxy.Proxy
	// url is the service's URL with the proxy's address in place of the service's.
	url string
}

// proxy starts a proxy in front of the host of rawURL, stopped when the test ends.
func (f *fixture) proxy(rawURL string) *tcpProxy {
	f.t.Helper()
	p, via, err := tcpproxy.ForURL(rawURL)
	require.NoError(f.t, err)
	f.t.Cleanup(p.Close)
	return &tcpProxy{proxy: p, url: via}
}

// cut closes every connection through the proxy and refuses new ones until restore.
func (p *tcpProxy) cut() { p.proxy.Cut() }

// restore accepts connections again, on the same address.
func (p *tcpProxy) restore(t testing.TB) {
	t.Helper()
	require.NoError(t, p.proxy.Restore())
}
