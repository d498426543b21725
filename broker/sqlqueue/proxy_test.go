package sqlqueue_test

import (
	"errors"
	"net/url"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
)

// tcpProxy is a loopback TCP proxy in front of the test's database server, run in-process by
// toxiproxy, to cut its connections.
type tcpProxy struct {
	proxy *toxiproxy.Proxy
	// url is the database URL with the proxy's address in place of the server's.
	url string
}

// proxy starts a proxy in front of the env's server, stopped when the test ends.
func (e *env) proxy() *tcpProxy {
	e.t.Helper()
	u, err := url.Parse(e.url)
	require.NoError(e.t, err)
	server := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(server, "db", "127.0.0.1:0", u.Host)
	require.NoError(e.t, p.Start())
	e.t.Cleanup(p.Stop)
	u.Host = p.Listen
	return &tcpProxy{proxy: p, url: u.String()}
}

// cut closes every connection through the proxy and refuses new ones until restore.
func (p *tcpProxy) cut() { p.proxy.Stop() }

// restore accepts connections again, on the same address.
func (p *tcpProxy) restore(t testing.TB) {
	t.Helper()
	var err error
	// The port was just released; binding it again can fail for a moment.
	for range 100 {
		if err = p.proxy.Start(); err == nil || errors.Is(err, toxiproxy.ErrProxyAlreadyStarted) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("restart the proxy on %s: %v", p.proxy.Listen, err)
}
