package testsvc

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// Child is a consumer process that a test kills while it holds a message: this test binary,
// running the package's TestKilledConsumer_Child, which says what it does on its stdout, a
// line each, a word first (SayHolding: HOLDING <uuid> <count>). StartChild starts one.
type Child struct {
	cmd    *exec.Cmd
	lines  chan string
	killed chan struct{}
	once   sync.Once
}

// StartChild starts this test binary running TestKilledConsumer_Child, with env (NAME=value)
// added to its environment. The process is killed when t ends, if not before.
func StartChild(t testing.TB, env ...string) *Child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledConsumer_Child$", "-test.timeout=120s")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	c := &Child{cmd: cmd, lines: make(chan string), killed: make(chan struct{})}
	t.Cleanup(c.Kill)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case c.lines <- sc.Text():
			case <-c.killed:
				return
			}
		}
	}()
	return c
}

// Expect returns the rest of the child's next line that begins with word, failing t when none
// comes within timeout.
func (c *Child) Expect(t testing.TB, word string, timeout time.Duration) string {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case line := <-c.lines:
			if rest, ok := strings.CutPrefix(line, word+" "); ok {
				return rest
			}
		case <-timer.C:
			t.Fatalf("the consumer process did not say %s within %s", word, timeout)
			return ""
		}
	}
}

// Holding returns the UUID and the delivery count of the message that the child says it holds
// (SayHolding), failing t when it says nothing within timeout.
func (c *Child) Holding(t testing.TB, timeout time.Duration) (id string, count int) {
	t.Helper()
	line := c.Expect(t, "HOLDING", timeout)
	_, err := fmt.Sscanf(line, "%s %d", &id, &count)
	require.NoError(t, err, line)
	return id, count
}

// Kill kills the process with SIGKILL, which closes nothing, and waits for it to end. It is
// idempotent.
func (c *Child) Kill() {
	c.once.Do(func() {
		close(c.killed)
		_ = c.cmd.Process.Signal(syscall.SIGKILL)
		_ = c.cmd.Wait()
	})
}

// SayHolding is the child's side: it says on stdout that it holds m, with the delivery count
// of m's redelivery.Info (HOLDING <uuid> <count>), failing t when m has none.
func SayHolding(t testing.TB, m *message.Message) {
	t.Helper()
	fmt.Printf("HOLDING %s %d\n", m.UUID, Info(t, m).Count)
}
