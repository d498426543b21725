package redis_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	redissub "github.com/onceflow/onceflow/broker/redis"
)

// Environment of the consumer process that the killed-consumer tests start (this test binary,
// running TestKilledConsumer_Child).
const (
	childURLEnv    = "ONCEFLOW_REDIS_TEST_CHILD_URL"
	childTopicEnv  = "ONCEFLOW_REDIS_TEST_CHILD_TOPIC"
	childNackEnv   = "ONCEFLOW_REDIS_TEST_CHILD_NACK_AFTER" // a delay: nack with it instead of holding
	childAckTOEnv  = "ONCEFLOW_REDIS_TEST_CHILD_ACK_TIMEOUT"
	childDirectEnv = "ONCEFLOW_REDIS_TEST_CHILD_DIRECT" // set: settle directly (redelivery.WithDirectSettle)
	childHoldingAs = "HOLDING"
	childNackedAs  = "NACKED"
)

// TestKilledConsumer_Child is the consumer process of the killed-consumer tests. It takes the
// first delivery of the topic and says so on stdout (HOLDING <uuid> <count>). With a nack
// delay, it nacks the delivery with it, waits until Redis has the delay, and says so (NACKED
// <uuid> <unix ms of the nack>). Then it waits to be killed.
func TestKilledConsumer_Child(t *testing.T) {
	rawURL := os.Getenv(childURLEnv)
	if rawURL == "" {
		t.Skip("run by the killed-consumer tests")
	}
	topic := os.Getenv(childTopicEnv)
	ackTimeout, err := time.ParseDuration(os.Getenv(childAckTOEnv))
	require.NoError(t, err)
	opts, err := redis.ParseURL(rawURL)
	require.NoError(t, err)
	opts.MaxRetries = -1
	client := redis.NewClient(opts)
	sub, err := redissub.NewSubscriber(client, redissub.Config{ConsumerGroup: group, AckTimeout: ackTimeout})
	require.NoError(t, err)
	ctx := context.Background()
	direct := os.Getenv(childDirectEnv) != ""
	if direct {
		ctx = redelivery.WithDirectSettle(ctx)
	}
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, ch, 30*time.Second)
	fmt.Printf("%s %s %d\n", childHoldingAs, m.UUID, info(t, m).Count)
	if v := os.Getenv(childNackEnv); v != "" {
		delay, err := time.ParseDuration(v)
		require.NoError(t, err)
		nackedAt := time.Now()
		require.True(t, redelivery.NackAfter(m, delay))
		redelivery.Settle(m)
		// The delay is in Redis once the entry's idle time has jumped ahead.
		for {
			xps, err := client.XPendingExt(context.Background(), &redis.XPendingExtArgs{Stream: topic, Group: group, Start: "-", End: "+", Count: 1}).Result()
			require.NoError(t, err)
			if len(xps) == 1 && xps[0].Idle > ackTimeout-delay-time.Second {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		fmt.Printf("%s %s %d\n", childNackedAs, m.UUID, nackedAt.UnixMilli())
	}
	select {}
}

// child is a consumer process started by a test.
type child struct {
	cmd   *exec.Cmd
	lines chan []string
}

func (f *fixture) startChild(ackTimeout, nackAfter time.Duration) *child {
	f.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKilledConsumer_Child$", "-test.timeout=120s")
	cmd.Env = append(os.Environ(), childURLEnv+"="+f.url, childTopicEnv+"="+f.topic, childAckTOEnv+"="+ackTimeout.String())
	if nackAfter > 0 {
		cmd.Env = append(cmd.Env, childNackEnv+"="+nackAfter.String())
	}
	if f.direct {
		cmd.Env = append(cmd.Env, childDirectEnv+"=1")
	}
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(f.t, err)
	require.NoError(f.t, cmd.Start())
	c := &child{cmd: cmd, lines: make(chan []string, 10)}
	f.t.Cleanup(func() { c.kill() })
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if fields := strings.Fields(sc.Text()); len(fields) == 3 && (fields[0] == childHoldingAs || fields[0] == childNackedAs) {
				c.lines <- fields
			}
		}
	}()
	return c
}

// expect returns the uuid and number of the child's next line, which must be kind.
func (c *child) expect(t *testing.T, kind string) (string, int64) {
	t.Helper()
	select {
	case fields := <-c.lines:
		require.Equal(t, kind, fields[0])
		n, err := strconv.ParseInt(fields[2], 10, 64)
		require.NoError(t, err)
		return fields[1], n
	case <-time.After(60 * time.Second):
		t.Fatalf("the consumer process did not say %s", kind)
		return "", 0
	}
}

// kill kills the process with SIGKILL: it closes nothing.
func (c *child) kill() {
	if c.cmd.ProcessState == nil {
		_ = c.cmd.Process.Signal(syscall.SIGKILL)
		_ = c.cmd.Wait()
	}
}

// A crash loop caused by one message must end: each consumer killed while holding the entry
// leaves it to the next with the delivery count one higher, because the count is Redis's.
func TestKilledConsumer_DeliveryCountSurvives(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		want := f.publish(1)[0]
		const ackTimeout = 500 * time.Millisecond

		for n := int64(1); n <= 2; n++ {
			c := f.startChild(ackTimeout, 0)
			id, count := c.expect(t, childHoldingAs)
			require.Equal(t, want.UUID, id)
			require.Equal(t, n, count, "delivery count seen by consumer process %d", n)
			c.kill()
		}
		_, ch := f.subscribe(redissub.Config{AckTimeout: ackTimeout})
		m := receive(t, ch, 30*time.Second)
		require.Equal(t, want.UUID, m.UUID)
		require.Equal(t, 3, info(t, m).Count)
		m.Ack()
	})
}

// The delay of a nack is kept in Redis: the entry of a consumer killed right after it nacked
// comes back to another consumer when the delay has passed, not sooner, and well before the
// ack timeout.
func TestKilledConsumer_DelayedNackStillComesBack(t *testing.T) {
	t.Parallel()
	inBothModes(t, func(t *testing.T, f *fixture) {
		want := f.publish(1)[0]
		const ackTimeout, delay = 10 * time.Second, 1500 * time.Millisecond

		c := f.startChild(ackTimeout, delay)
		_, count := c.expect(t, childHoldingAs)
		require.EqualValues(t, 1, count)
		_, nackedMs := c.expect(t, childNackedAs)
		c.kill()
		nacked := time.UnixMilli(nackedMs)

		_, ch := f.subscribe(redissub.Config{AckTimeout: ackTimeout})
		m := receive(t, ch, 30*time.Second)
		since := time.Since(nacked)
		require.Equal(t, want.UUID, m.UUID)
		require.GreaterOrEqual(t, since, delay, "came back before the delay")
		require.Less(t, since, ackTimeout, "came back by the ack timeout, not by the delay")
		require.Equal(t, 2, info(t, m).Count)
		m.Ack()
	})
}
