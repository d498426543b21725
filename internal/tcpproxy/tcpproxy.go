// Package tcpproxy is a loopback TCP proxy in front of a network service, whose connections a
// test cuts at once.
//
// Each accepted connection dials the service in its own goroutine, with a timeout: a service
// slow to answer one dial never stops the proxy from accepting the next connection.
package tcpproxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"time"
)

// DialTimeout bounds each dial of the service. A connection whose dial fails is closed.
const DialTimeout = 3 * time.Second

// defaultPorts are the ports of service URLs that name none.
var defaultPorts = map[string]string{
	"postgres": "5432", "postgresql": "5432", "mysql": "3306", "mariadb": "3306",
	"amqp": "5672", "amqps": "5671", "nats": "4222", "redis": "6379", "rediss": "6379",
}

// Proxy forwards the connections it accepts on a loopback address to its upstream.
type Proxy struct {
	upstream string
	addr     string
	dial     func(network, address string, timeout time.Duration) (net.Conn, error)
	dropping atomic.Bool // bytes both ways are discarded: the service looks alive and is silent

	mu     sync.Mutex
	ln     net.Listener // nil while cut
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// Start starts a proxy to upstream (host:port) on a free loopback port.
func Start(upstream string) (*Proxy, error) { return start(upstream, net.DialTimeout) }

func start(upstream string, dial func(network, address string, timeout time.Duration) (net.Conn, error)) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("tcpproxy: listen: %w", err)
	}
	p := &Proxy{upstream: upstream, addr: ln.Addr().String(), dial: dial, conns: map[net.Conn]struct{}{}}
	p.serve(ln)
	return p, nil
}

// ForURL starts a proxy in front of the host of rawURL and returns it with rawURL through it:
// the proxy's address in place of the service's. A URL without a port takes its scheme's
// default port.
func ForURL(rawURL string) (*Proxy, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, "", fmt.Errorf("tcpproxy: %w", err)
	}
	if u.Host == "" {
		return nil, "", fmt.Errorf("tcpproxy: URL %q names no host", u.Redacted())
	}
	upstream := u.Host
	if u.Port() == "" {
		port, ok := defaultPorts[u.Scheme]
		if !ok {
			return nil, "", fmt.Errorf("tcpproxy: URL %q has no port and scheme %q has no known default", u.Redacted(), u.Scheme)
		}
		upstream = net.JoinHostPort(u.Hostname(), port)
	}
	p, err := Start(upstream)
	if err != nil {
		return nil, "", err
	}
	u.Host = p.addr
	return p, u.String(), nil
}

// Addr is the proxy's address, the same across cuts.
func (p *Proxy) Addr() string { return p.addr }

// Cut closes every connection through the proxy and refuses new ones until Restore.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cutLocked()
}

func (p *Proxy) cutLocked() {
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
}

// Restore accepts connections again, on the same address. Binding a port just released can
// fail for a moment, so it tries for up to two seconds.
func (p *Proxy) Restore() error {
	var err error
	for range 100 {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return errors.New("tcpproxy: restore of a closed proxy")
		}
		if p.ln != nil {
			p.mu.Unlock()
			return nil
		}
		var ln net.Listener
		if ln, err = net.Listen("tcp", p.addr); err == nil {
			p.serveLocked(ln)
			p.mu.Unlock()
			return nil
		}
		p.mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("tcpproxy: listen again on %s: %w", p.addr, err)
}

// Blackhole makes the proxy discard every byte both ways, on the connections open now and on
// those it accepts later, without closing any: the service looks alive and never answers.
func (p *Proxy) Blackhole() { p.dropping.Store(true) }

// Close cuts every connection, stops the proxy for good and waits for its goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.cutLocked()
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) serve(ln net.Listener) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.serveLocked(ln)
}

func (p *Proxy) serveLocked(ln net.Listener) {
	p.ln = ln
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return // cut or closed
			}
			if !p.track(ln, c) {
				c.Close()
				return
			}
			p.wg.Add(1)
			go p.forward(ln, c)
		}
	}()
}

// track records c as open, unless ln was cut since it accepted c.
func (p *Proxy) track(ln net.Listener, c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != ln {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

// forward dials the upstream for client and copies bytes both ways until either side closes.
func (p *Proxy) forward(ln net.Listener, client net.Conn) {
	defer p.wg.Done()
	server, err := p.dial("tcp", p.upstream, DialTimeout)
	if err != nil {
		p.untrack(client)
		return
	}
	if !p.track(ln, server) {
		server.Close()
		p.untrack(client)
		return
	}
	done := make(chan struct{}, 2)
	go func() { p.copy(server, client); done <- struct{}{} }()
	go func() { p.copy(client, server); done <- struct{}{} }()
	<-done // one side ended: closing both ends the other
	p.untrack(client)
	p.untrack(server)
	<-done
}

// copy copies from src to dst until src ends or a write fails, discarding what it reads while
// the proxy is a black hole.
func (p *Proxy) copy(dst io.Writer, src io.Reader) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.dropping.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
