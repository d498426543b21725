package testsvc

import (
	"context"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// Cost adds up what the test process spends between Start and Stop: heap allocations and CPU
// time (user and system, of every goroutine). A benchmark of a subscriber measures its consumer
// with it, the broker running in a process of its own. The zero value is ready to use.
type Cost struct {
	mallocs uint64
	cpu     time.Duration
	// At the Start not stopped yet.
	startMallocs uint64
	startCPU     time.Duration
}

// Start starts a span of the measurement.
func (c *Cost) Start() {
	c.startMallocs, c.startCPU = mallocs(), processCPU()
}

// Stop ends the span that Start started, and adds it up.
func (c *Cost) Stop() {
	c.cpu += processCPU() - c.startCPU
	c.mallocs += mallocs() - c.startMallocs
}

// Report reports, on b, the allocations and the µs of CPU per message of the spans measured,
// for n messages.
func (c *Cost) Report(b *testing.B, n int) {
	b.ReportMetric(float64(c.mallocs)/float64(n), "allocs/msg")
	b.ReportMetric(float64(c.cpu.Microseconds())/float64(n), "cpu-µs/msg")
}

// Drain subscribes sub to topic with ctx, acks each of the first n messages as it arrives
// (and settles it, for a consumer that settles directly: redelivery.Settle), and closes sub.
// It reports on b msgs/s from the Subscribe to the end of the Close, and the Cost of that
// span per message.
func Drain(b *testing.B, sub message.Subscriber, ctx context.Context, topic string, n int) {
	b.Helper()
	start := time.Now()
	var cost Cost
	cost.Start()
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		b.Fatal(err)
	}
	for range n {
		m, ok := <-ch
		if !ok {
			b.Fatal("subscription closed")
		}
		m.Ack()
		redelivery.Settle(m)
	}
	if err := sub.Close(); err != nil {
		b.Fatal(err)
	}
	cost.Stop()
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(n)/elapsed.Seconds(), "msgs/s")
	cost.Report(b, n)
}

func mallocs() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Mallocs
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
