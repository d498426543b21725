package onceflowtest

import (
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/onceflow/onceflow/internal/tcpproxy"
)

// cutDuration is how long a connection cut lasts: long enough that clients notice and
// reconnect, short enough that the run goes on.
const cutDuration = 500 * time.Millisecond

// proxies puts a loopback TCP proxy in front of each network service of a run, so that the
// connections of every consumer to it can be cut at once.
type proxies struct {
	list  []*tcpproxy.Proxy
	names []string // "database" or "broker", per proxy
}

// newProxies starts a proxy for each URL that names a host and port, and returns the URLs
// the consumers use: the originals with the proxy's address in place of the service's.
func newProxies(brokerURL, dbURL string) (*proxies, string, string, error) {
	p := &proxies{}
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
	proxy, via, err := tcpproxy.ForURL(rawURL)
	if err != nil {
		return "", fmt.Errorf("start %s proxy: %w", name, err)
	}
	p.list = append(p.list, proxy)
	p.names = append(p.names, name)
	return via, nil
}

// cuttable reports whether any connection can be cut.
func (p *proxies) cuttable() bool { return len(p.list) > 0 }

// cut drops every connection through the i-th proxy (round robin) and refuses new ones for
// cutDuration. It returns the name of the service cut.
func (p *proxies) cut(i int) (string, error) {
	proxy := p.list[i%len(p.list)]
	proxy.Cut()
	time.Sleep(cutDuration)
	if err := proxy.Restore(); err != nil {
		return "", err
	}
	return p.names[i%len(p.list)], nil
}

func (p *proxies) close() {
	for _, proxy := range p.list {
		proxy.Close()
	}
}
