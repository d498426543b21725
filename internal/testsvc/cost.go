package testsvc

import (
	"runtime"
	"syscall"
	"testing"
	"time"
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
