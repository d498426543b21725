package redis

import (
	"testing"
	"time"
)

// SetFillWait sets, until t ends, how long free room in a subscription's window waits to grow
// to half the window before it is asked for anyway. Tests that call it must not run in
// parallel: the wait is the package's.
func SetFillWait(t testing.TB, d time.Duration) {
	old := fillWait
	fillWait = d
	t.Cleanup(func() { fillWait = old })
}
