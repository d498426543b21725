package onceflowtest

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
)

// Prove runs the handler of cfg under faults, as Run does, in consumer processes that are the
// test binary running the calling test again, and fails t, with an account of each message
// that went wrong and of the faults it met, unless every message was applied exactly once (in
// order, for ExactlyOnceInOrder) and every poison message dead-lettered exactly once. It
// returns the report.
//
// In a consumer process, the calling test runs again up to Prove, which runs the consumer and
// ends the process: what the test does before Prove runs in every consumer too, so keep it
// cheap, and give the handler what it needs through Config.Handler and Config.Setup. A test
// may call Prove more than once (the consumers of the second run the test past the first,
// whose Prove returns a zero Report there); one per subtest reads best.
func Prove(t testing.TB, cfg Config) Report {
	t.Helper()
	if IsConsumer() {
		serveTest(t, cfg)
		return Report{} // the consumer of another test's Prove
	}
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	n := call(t)
	t.Cleanup(func() { // the test may run again (-count)
		calls.mu.Lock()
		delete(calls.n, t.Name())
		calls.mu.Unlock()
	})
	if len(cfg.Command) == 0 {
		exe, err := os.Executable()
		if err != nil {
			t.Fatalf("onceflowtest: the test binary: %v", err)
		}
		cfg.Command = []string{exe, "-test.run=" + runPattern(t.Name()), "-test.count=1"}
	}
	keep := cfg.Dir != ""
	if !keep {
		cfg.Dir = t.TempDir()
	}
	if cfg.Name == "" {
		cfg.Name = t.Name()
	}
	r, err := run(t.Context(), cfg.withDefaults(), testCall{name: t.Name(), n: n})
	if keep {
		r.Logs = cfg.Dir
	}
	if err != nil {
		logTails(t, cfg.Dir)
		t.Fatalf("onceflowtest: %v", err)
	}
	t.Log(r.String())
	if err := r.Err(); err != nil {
		logTails(t, cfg.Dir)
		t.Error(err)
	}
	return r
}

// serveTest runs this process as the consumer of the run whose test is t, and ends it; it
// returns when the run is another test's.
func serveTest(t testing.TB, cfg Config) {
	s, err := readSpec()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if s.Test != t.Name() || s.Call != call(t) {
		return
	}
	if err := cfg.validate(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if err := serve(t.Context(), s, cfg.Handler); err != nil {
		fmt.Fprintln(os.Stderr, "onceflowtest consumer:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// runPattern returns the -test.run pattern that selects the test named name, and no other.
func runPattern(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}

// calls counts the calls of Prove by test, while each test runs: a consumer process serves the
// call whose number its spec gives.
var calls struct {
	mu sync.Mutex
	n  map[string]int
}

// call returns the number of this call of Prove in test t, from 1.
func call(t testing.TB) int {
	calls.mu.Lock()
	defer calls.mu.Unlock()
	if calls.n == nil {
		calls.n = map[string]int{}
	}
	calls.n[t.Name()]++
	return calls.n[t.Name()]
}

// logTails logs the last lines of each consumer's log in dir, which goes with the test.
func logTails(t testing.TB, dir string) {
	t.Helper()
	const lines, width = 5, 300
	logs, _ := filepath.Glob(filepath.Join(dir, "consumer-*.log"))
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			continue
		}
		all := strings.Split(strings.TrimSpace(string(b)), "\n")
		tail := all[max(0, len(all)-lines):]
		for i, line := range tail {
			if len(line) > width {
				tail[i] = line[:width] + "..."
			}
		}
		t.Logf("the end of %s:\n%s", filepath.Base(l), strings.Join(tail, "\n"))
	}
}
