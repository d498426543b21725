package conformance

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
)

// This file collects what a scenario reads besides effects: the dead letters of the broker's
// dead-letter topic, and the log lines of its routers and consumers, in the test's log.

// deadLetters collects the messages of the fixture's dead-letter topic.
type deadLetters struct {
	mu   sync.Mutex
	msgs []*message.Message
}

// collectDeadLetters consumes the fixture's dead-letter topic from b until the test ends.
func (f *fixture) collectDeadLetters(b *broker.Broker) *deadLetters {
	f.t.Helper()
	sub, err := b.Subscriber()
	require.NoError(f.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, f.dlq)
	require.NoError(f.t, err)
	d := &deadLetters{}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		for m := range ch {
			d.mu.Lock()
			d.msgs = append(d.msgs, m)
			d.mu.Unlock()
			m.Ack()
		}
	}()
	f.t.Cleanup(func() {
		cancel()
		_ = sub.Close()
		<-stopped
	})
	return d
}

func (d *deadLetters) all() []*message.Message {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]*message.Message(nil), d.msgs...)
}

// testWriter writes log lines to the test's log until the test ends, and drops them after,
// when a straggling goroutine may still log.
type testWriter struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func newTestWriter(t *testing.T) *testWriter {
	w := &testWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return w
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(string(p))
	}
	return len(p), nil
}

// lazy formats as the value fn returns when it is formatted: a failure message shows the
// state at the failure, not when the wait began.
type lazy func() any

func (l lazy) String() string { return fmt.Sprint(l()) }
