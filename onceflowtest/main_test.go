package onceflowtest_test

import (
	"flag"
	"os"
	"testing"
)

// TestMain runs the tests of this package all at once unless -parallel says otherwise: each
// waits on its consumer processes and the faults for seconds, and computes little.
func TestMain(m *testing.M) {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		_ = flag.Set("test.parallel", "8")
	}
	os.Exit(m.Run())
}
