package conformance

import (
	"errors"
	"net"
	"net/url"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"
)

// defaultPorts are the ports of URLs that name none.
var defaultPorts = map[string]string{
	"postgres": "5432", "postgresql": "5432", "mysql": "3306", "mariadb": "3306",
	"amqp": "5672", "amqps": "5671", "nats": "4222", "redis": "6379", "rediss": "6379",
}

// tcpProxy is a loopback TCP proxy in front of a broker, run in-process by toxiproxy.
type tcpProxy struct {
	proxy *toxiproxy.Proxy
	// url is the broker's URL with the proxy's address in place of the broker's.
	url string
}

// proxy starts a proxy in front of the host of rawURL, stopped when the test ends.
func (f *fixture) proxy(rawURL string) *tcpProxy {
	f.t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(f.t, err)
	upstream := u.Host
	if u.Port() == "" {
		port, ok := defaultPorts[u.Scheme]
		require.True(f.t, ok, "broker URL scheme %q has no default port; give the port", u.Scheme)
		upstream = net.JoinHostPort(u.Hostname(), port)
	}
	server := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(server, "broker", "127.0.0.1:0", upstream)
	require.NoError(f.t, p.Start())
	f.t.Cleanup(p.Stop)
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
	for attempt := 0; attempt < 100; attempt++ {
		if err = p.proxy.Start(); err == nil || errors.Is(err, toxiproxy.ErrProxyAlreadyStarted) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("restart the proxy on %s: %v", p.proxy.Listen, err)
}
