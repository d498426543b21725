package testsvc

import (
	"net"
	"sync"
	"testing"
)

// SilentListener listens on a loopback port and accepts every connection without ever reading
// or writing a byte: a server that has hung after accept, or a firewall that completes the TCP
// handshake. It returns the host:port to dial; the listener and the connections it accepted
// are closed when the test ends.
func SilentListener(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen on loopback: %v", err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
		done  = make(chan struct{})
	)
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().String()
}
