package onceflowtest

import (
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// cutDuration is how long a connection cut lasts: long enough that clients notice and
// reconnect, short enough that the run goes on.
const cutDuration = 500 * time.Millisecond

// proxies puts a loopback TCP proxy in front of each network service of a run, so that the
// connections of every consumer to it can be cut at once.
type proxies struct {
	server *toxiproxy.ApiServer
	list   []*toxiproxy.Proxy
	names  []string // "database" or "broker", per proxy
}

// newProxies starts a proxy for each URL that names a host and port, and returns the URLs
// the consumers use: the originals with the proxy's address in place of the service's.
func newProxies(brokerURL, dbURL string) (*proxies, string, string, error) {
	p := &proxies{server: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())}
	viaBroker, err := p.add("broker", brokerURL)
	if err != nil {
		p.close()
		return nil, "", "", err
	}
	viaDB, err := p.add("database", dbURL)
	if err != nil {
		p.close()
		return nil, "", "", err
	}
	return p, viaBroker, viaDB, nil
}

func (p *proxies) add(name, rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || u.Host == "" || strings.HasPrefix(u.Scheme, "sqlite") || u.Scheme == "mem" {
		return rawURL, nil // nothing to cut: an embedded or in-process service
	}
	if u.Scheme == "kafka" {
		// Kafka clients reach the brokers at the addresses the cluster advertises, not
		// through a proxy in front of the seed broker: a cut there would cut nothing.
		return rawURL, nil
	}
	upstream := u.Host
	if u.Port() == "" {
		port, ok := defaultPorts[u.Scheme]
		if !ok {
			return "", fmt.Errorf("%s URL has no port and scheme %q has no known default", name, u.Scheme)
		}
		upstream = net.JoinHostPort(u.Hostname(), port)
	}
	proxy := toxiproxy.NewProxy(p.server, name, "127.0.0.1:0", upstream)
	if err := proxy.Start(); err != nil {
		return "", fmt.Errorf("start %s proxy: %w", name, err)
	}
	p.list = append(p.list, proxy)
	p.names = append(p.names, name)
	u.Host = proxy.Listen
	return u.String(), nil
}

var defaultPorts = map[string]string{
	"postgres": "5432", "postgresql": "5432", "mysql": "3306", "mariadb": "3306",
	"amqp": "5672", "amqps": "5671", "nats": "4222", "redis": "6379",
}

// cuttable reports whether any connection can be cut.
func (p *proxies) cuttable() bool { return len(p.list) > 0 }

// cut drops every connection through the i-th proxy (round robin) and refuses new ones for
// cutDuration. It returns the name of the service cut.
func (p *proxies) cut(i int) string {
	proxy := p.list[i%len(p.list)]
	proxy.Stop()
	time.Sleep(cutDuration)
	// The port is free again; the proxy listens on the same address as before.
	for attempt := 0; attempt < 50; attempt++ {
		if err := proxy.Start(); err == nil || err == toxiproxy.ErrProxyAlreadyStarted {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return p.names[i%len(p.list)]
}

func (p *proxies) close() {
	for _, proxy := range p.list {
		proxy.Stop()
	}
}
