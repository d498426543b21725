package conformance

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
)

// This file supervises the consumers of the Poison scenario: a pool starts them as child
// processes of the test binary (or routers in the test process), restarts the ones the crash
// loop kills, and stops them all.

// pool runs size consumers of one handler of the Poison scenario, and starts a new one when
// one dies, as a process supervisor does.
type pool struct {
	f      *fixture
	name   string
	topic  string
	size   int
	child  bool
	spec   consumerSpec
	tally  *tally
	starts sync.WaitGroup // the first size consumers
	runs   sync.WaitGroup // supervisors, and routers in this process

	mu      sync.Mutex
	next    int
	live    map[int]*consumerProc
	died    []time.Time
	err     error
	stopped bool
}

// consumerProc is one consumer of a pool.
type consumerProc struct {
	n    int
	done chan struct{} // closed when it has died or stopped
	// crashed reports, once done is closed, whether it died the way the crash loop kills.
	crashed func() bool
	// why describes how it ended, for failures.
	why func() string
	// diedAt, if not nil, is when it died: a router in this process ends some time after.
	diedAt func() time.Time
	kill   func()
}

func (f *fixture) newPool(name, topic string, size int) *pool {
	tm := f.timings
	tm.AckTimeout = min(tm.AckTimeout, poisonAckTimeout)
	p := &pool{
		f: f, name: name, topic: topic, size: size, tally: newTally(), live: map[int]*consumerProc{},
		// A chain edit of the setup is a function, which cannot reach a child process.
		child: consumerMainCalled.Load() && scheme(f.brokerURL) != "mem" && f.edit == nil,
		spec: consumerSpec{BrokerURL: f.brokerURL, DatabaseURL: f.dbURL, Mode: f.mode, Timings: tm,
			DeadLetterTopic: f.dlq, Handler: name, Topic: topic},
	}
	f.t.Cleanup(p.stop)
	return p
}

func (p *pool) kind() string {
	if p.child {
		return "child processes killed with SIGKILL"
	}
	return "routers in the test process, closed abruptly"
}

// start starts the pool's consumers; waitReady waits until they have subscribed.
func (p *pool) start() {
	for range p.size {
		p.starts.Add(1)
		go func() {
			defer p.starts.Done()
			p.spawn()
		}()
	}
}

func (p *pool) waitReady() {
	p.f.t.Helper()
	p.starts.Wait()
	require.NoError(p.f.t, p.failure(), "start the consumers of %s", p.name)
}

// failure returns why the pool cannot go on, if it cannot.
func (p *pool) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

func (p *pool) fail(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err == nil && !p.stopped {
		p.err = err
	}
}

// deaths returns how many consumers died; lastDeath when the last one did.
func (p *pool) deaths() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.died)
}

func (p *pool) lastDeath() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.died) == 0 {
		return time.Time{}
	}
	return p.died[len(p.died)-1]
}

// heldByTheDead reports whether a consumer that died held the message id, published at
// published: a delivery of it ended with the death, the broker counted a delivery of it that
// no router saw (a window of leases, a prefetch), or it was published before a death and first
// delivered after it (a broker that counts no deliveries, whose client had it in a buffer).
func (p *pool) heldByTheDead(id string, published time.Time) bool {
	c := p.tally.get(id)
	if c.Lost > 0 || c.BrokerCount > c.Deliveries {
		return true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range p.died {
		if published.Before(d) && c.First.After(d) {
			return true
		}
	}
	return false
}

// spawn starts a consumer, waits until it has subscribed, and supervises it.
func (p *pool) spawn() {
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return
	}
	n := p.next
	p.next++
	p.mu.Unlock()

	launch := p.launchInProcess
	if p.child {
		launch = p.launchChild
	}
	c, err := launch(n)
	if err != nil {
		p.fail(fmt.Errorf("consumer %d: %w", n, err))
		return
	}
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		c.kill()
		return
	}
	p.live[n] = c
	p.runs.Add(1)
	p.mu.Unlock()
	go p.supervise(c)
}

// supervise waits for c to end: a death by the crash loop is counted and the consumer started
// again at once; any other end fails the pool.
func (p *pool) supervise(c *consumerProc) {
	defer p.runs.Done()
	<-c.done
	p.mu.Lock()
	delete(p.live, c.n)
	stopped := p.stopped
	p.mu.Unlock()
	if stopped {
		return
	}
	if !c.crashed() {
		p.fail(fmt.Errorf("consumer %d ended: %s", c.n, c.why()))
		return
	}
	at := time.Now()
	if c.diedAt != nil {
		at = c.diedAt()
	}
	p.tally.died(c.n)
	p.mu.Lock()
	p.died = append(p.died, at)
	p.mu.Unlock()
	p.spawn()
}

// stop kills every consumer and waits for them.
func (p *pool) stop() {
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return
	}
	p.stopped = true
	live := make([]*consumerProc, 0, len(p.live))
	for _, c := range p.live {
		live = append(live, c)
	}
	p.mu.Unlock()
	p.starts.Wait()
	for _, c := range live {
		c.kill()
	}
	p.runs.Wait()
}

// launchChild starts consumer n as a child process of the test binary and waits until it has
// subscribed.
func (p *pool) launchChild(n int) (*consumerProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	spec, err := json.Marshal(p.spec)
	if err != nil {
		return nil, err
	}
	// -test.run=^$: a binary that did not call ConsumerMain would run no test.
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), consumerEnv+"="+string(spec))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	stderr := &tailWriter{prefix: fmt.Sprintf("%s consumer %d: ", p.name, n), to: newTestWriter(p.f.t)}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &consumerProc{n: n, done: make(chan struct{})}
	c.crashed = func() bool { return cmd.ProcessState != nil && cmd.ProcessState.ExitCode() == -1 } // a signal
	c.why = func() string { return fmt.Sprintf("%s: %s", cmd.ProcessState, stderr.tail()) }
	c.kill = func() {
		_ = stdin.Close()
		_ = cmd.Process.Kill()
		<-c.done
	}
	ready := make(chan bool, 1)
	go func() {
		// Everything the consumer wrote is read before Wait, and before done says it died. A
		// delivery may reach its router between the subscription and "ready": its line comes
		// first and counts like any other.
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		subscribed := false
		for sc.Scan() {
			if !subscribed && sc.Text() == "ready" {
				subscribed = true
				ready <- true
				continue
			}
			fields := strings.SplitN(sc.Text(), " ", 3)
			if len(fields) != 3 || len(fields[0]) != 1 {
				continue
			}
			count, err1 := strconv.Atoi(fields[1])
			id, err2 := strconv.Unquote(fields[2])
			if err1 != nil || err2 != nil {
				continue
			}
			p.tally.event(n, fields[0][0], count, id)
		}
		if !subscribed {
			ready <- false
		}
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait()
		close(c.done)
	}()
	select {
	case ok := <-ready:
		if !ok {
			<-c.done
			if c.crashed() {
				// The crash-loop message reached it between its subscription and its "ready":
				// a death like any other, which supervise counts.
				return c, nil
			}
			return nil, fmt.Errorf("exited before subscribing (%s): %s", cmd.ProcessState, stderr.tail())
		}
	case <-time.After(waitFor):
		c.kill()
		return nil, fmt.Errorf("did not subscribe within %s", waitFor)
	}
	return c, nil
}

// launchInProcess starts consumer n as a router in the test process, on a broker connection
// of its own. The crash-loop message "kills" it: the broker connection closes at once, which
// gives back (or abandons) what it holds unsettled, and the router stops.
func (p *pool) launchInProcess(n int) (*consumerProc, error) {
	var b *broker.Broker
	err := retryConnect(func() (err error) {
		b, err = broker.Open(context.Background(), p.spec.BrokerURL, brokerOptions(p.spec.Timings))
		return err
	})
	if err != nil {
		return nil, err
	}
	sub, err := b.Subscriber()
	if err != nil {
		_ = b.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopWatching := make(chan struct{})
	c := &consumerProc{n: n, done: make(chan struct{})}
	var crashed atomic.Bool
	var once sync.Once
	var diedAt time.Time
	end := func(crash bool) {
		once.Do(func() {
			crashed.Store(crash)
			diedAt = time.Now()
			if crash {
				p.tally.died(n) // what it holds now is lost, whatever the router does next
			}
			_ = b.Close()
			cancel()
			close(c.done)
		})
	}
	c.crashed = crashed.Load
	c.why = func() string { return "stopped" }
	c.diedAt = func() time.Time { return diedAt } // read after done, which end closes
	crash := func(ctx context.Context) {
		go end(true)
		select {
		case <-ctx.Done():
		case <-time.After(waitFor):
		}
	}
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(),
		DeadLetterTopic:     p.spec.DeadLetterTopic,
		Logger:              slog.New(ackLostReporter{Handler: p.f.logger.Handler(), report: func(id string) { p.tally.event(n, 'l', 0, id) }}),
		PurgeInterval:       -1,
		SkipMigrate:         true,
		CloseTimeout:        5 * time.Second,
	})
	if err == nil {
		report := func(kind byte, count int, id string) { p.tally.event(n, kind, count, id) }
		err = r.AddHandler(p.f.handler(poisonSpec(p.name, p.topic, crash), &reportingSubscriber{Subscriber: sub, report: report, stop: stopWatching}))
	}
	if err != nil {
		cancel()
		_ = b.Close()
		return nil, err
	}
	runDone := make(chan error, 1)
	p.runs.Add(1)
	go func() {
		defer p.runs.Done()
		err := r.Run(ctx)
		end(false)
		close(stopWatching) // the router has settled what it will
		runDone <- err
	}()
	c.kill = func() {
		end(false)
		<-runDone
	}
	select {
	case <-r.Running():
		return c, nil
	case err := <-runDone:
		return nil, fmt.Errorf("router stopped before running: %w", err)
	case <-time.After(waitFor):
		c.kill()
		return nil, errors.New("router did not start")
	}
}

// tailWriter copies a consumer's standard error to the test log, a line at a time with a
// prefix, and keeps its last lines for failure messages.
type tailWriter struct {
	prefix string
	to     io.Writer

	mu    sync.Mutex
	buf   []byte
	lines []string
}

func (w *tailWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, b...)
	for {
		i := strings.IndexByte(string(w.buf), '\n')
		if i < 0 {
			break
		}
		line := string(w.buf[:i])
		w.buf = w.buf[i+1:]
		_, _ = io.WriteString(w.to, w.prefix+line)
		w.lines = append(w.lines, line)
		if len(w.lines) > 5 {
			w.lines = w.lines[1:]
		}
	}
	return len(b), nil
}

func (w *tailWriter) tail() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return strings.Join(append(w.lines, string(w.buf)), " | ")
}
