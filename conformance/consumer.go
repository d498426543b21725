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

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/sqldb"
)

// This file runs the consumers of the Poison scenario: child processes of the test binary
// that a message kills with SIGKILL, or routers in the test process where it cannot start
// them, and a supervisor that starts a new one when one dies.

// consumerEnv names the environment variable that makes the test binary a consumer process of
// the Poison scenario; its value is the consumer's consumerSpec, in JSON.
const consumerEnv = "ONCEFLOW_CONFORMANCE_CONSUMER"

// consumerMainCalled records that the test binary's TestMain calls ConsumerMain, so that the
// suite may start it as a consumer process.
var consumerMainCalled atomic.Bool

// ConsumerMain makes the test binary a consumer process of the Poison scenario when the suite
// started it as one: it runs the consumer until the suite kills it or closes its standard
// input, and exits. Otherwise it returns at once. Call it first in the TestMain of a package
// that runs the suite:
//
//	func TestMain(m *testing.M) {
//		conformance.ConsumerMain()
//		os.Exit(m.Run())
//	}
//
// Without it the Poison scenario runs its consumers as routers in the test process and, for
// the message that kills its consumer, closes one abruptly instead of killing a process.
func ConsumerMain() {
	consumerMainCalled.Store(true)
	raw, ok := os.LookupEnv(consumerEnv)
	if !ok {
		return
	}
	if err := runConsumer(raw); err != nil {
		fmt.Fprintln(os.Stderr, "conformance consumer:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// consumerSpec is what a consumer process of the Poison scenario runs.
type consumerSpec struct {
	BrokerURL       string  `json:"broker_url"`
	DatabaseURL     string  `json:"database_url"`
	Mode            Mode    `json:"mode"`
	Timings         Timings `json:"timings"`
	DeadLetterTopic string  `json:"dead_letter_topic"`
	Handler         string  `json:"handler"`
	Topic           string  `json:"topic"`
}

// runConsumer is the consumer process: the handler of spec on a router of its own. It writes
// "ready" on standard output once subscribed, then a line per delivery ("d <count> <id>", with
// the broker's delivery count, before the router gets it) and per settlement ("a 0 <id>" for an
// ack, "n 0 <id>" for a nack), and kills itself with SIGKILL when the crash-loop message reaches
// its processor.
func runConsumer(raw string) error {
	var spec consumerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return fmt.Errorf("%s: %w", consumerEnv, err)
	}
	ctx := context.Background()
	var db *sqldb.DB
	err := retryConnect(func() (err error) {
		db, err = sqldb.Open(ctx, spec.DatabaseURL)
		return err
	})
	if err != nil {
		return err
	}
	db.SetMaxOpenConns(3)
	var b *broker.Broker
	err = retryConnect(func() (err error) {
		b, err = broker.Open(ctx, spec.BrokerURL, brokerOptions(spec.Timings))
		return err
	})
	if err != nil {
		return err
	}
	sub, err := b.Subscriber()
	if err != nil {
		return err
	}
	out := &eventWriter{w: os.Stdout}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(),
		DeadLetterTopic:     spec.DeadLetterTopic,
		Logger:              logger,
		PurgeInterval:       -1,
		SkipMigrate:         true, // the suite created the tables
		CloseTimeout:        5 * time.Second,
	})
	if err != nil {
		return err
	}
	// The handler is built as the suite builds its own, from the mode and timings.
	f := &fixture{mode: spec.Mode, timings: spec.Timings, db: db}
	h := f.handler(poisonSpec(spec.Handler, spec.Topic, func(context.Context) { die() }), &reportingSubscriber{Subscriber: sub, report: out.event})
	if err := r.AddHandler(h); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		return fmt.Errorf("router stopped before running: %w", err)
	}
	out.line("ready")
	// Until the suite closes standard input, or dies.
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// die ends the process the way the OOM killer does: SIGKILL, no deferred function, no close.
func die() {
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Kill()
	}
	select {}
}

// eventWriter writes a consumer process's events to standard output, a line each.
type eventWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (e *eventWriter) line(s string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	_, _ = io.WriteString(e.w, s+"\n")
}

func (e *eventWriter) event(kind byte, count int, id string) {
	e.line(string(kind) + " " + strconv.Itoa(count) + " " + strconv.Quote(id))
}

// reportingSubscriber reports each delivery of its subscriptions, with the broker's delivery
// count (0 when it counts none), before passing the delivery on, and whether the router acked or
// nacked it.
type reportingSubscriber struct {
	message.Subscriber
	report func(kind byte, count int, id string)
	// stop ends the watches of deliveries never settled; nil in a consumer process, which
	// dies with them.
	stop <-chan struct{}
}

func (s *reportingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for m := range in {
			id := messageID(m)
			info, _ := redelivery.FromContext(m.Context())
			s.report('d', info.Count, id)
			go func() {
				select {
				case <-m.Acked():
					s.report('a', 0, id)
				case <-m.Nacked():
					s.report('n', 0, id)
				case <-s.stop:
				}
			}()
			select {
			case out <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// brokerOptions are the broker options of the suite's timings.
func brokerOptions(tm Timings) broker.Options {
	return broker.Options{NackDelay: tm.NackDelay, AckTimeout: tm.AckTimeout, PollInterval: tm.PollInterval}
}

// migrateRouterTables creates the dedup and delivery-count tables in the fixture's database, so
// that the Poison scenario's consumers need not each try.
func (f *fixture) migrateRouterTables() {
	f.t.Helper()
	ctx := context.Background()
	store, err := dedup.New(f.db, dedup.Config{})
	require.NoError(f.t, err)
	require.NoError(f.t, store.Migrate(ctx))
	counter, err := dedup.NewCounter(f.db, dedup.CounterConfig{})
	require.NoError(f.t, err)
	require.NoError(f.t, counter.Migrate(ctx))
}

// poisonCounts are the deliveries of one message to the consumers of a pool: Lost counts the
// deliveries that ended with the death of their consumer, neither acked nor nacked.
type poisonCounts struct {
	Deliveries, Acks, Nacks, Lost int
	// BrokerCount is the highest delivery count the broker gave the message (0 where it counts
	// none): above Deliveries when the broker handed it to a consumer that died before the
	// router saw it (a window of leases, a prefetch).
	BrokerCount int
	// First is when a consumer first reported a delivery of it.
	First time.Time
}

// tally counts the deliveries that the consumers of a pool report.
type tally struct {
	mu   sync.Mutex
	byID map[string]*poisonCounts
	open map[int]map[string]int // consumer -> message id -> deliveries not settled
	dead map[int]bool
	last time.Time // of the last delivery
}

func newTally() *tally {
	return &tally{byID: map[string]*poisonCounts{}, open: map[int]map[string]int{}, dead: map[int]bool{}}
}

// event records what consumer n reported; nothing is recorded of a consumer after its death.
func (t *tally) event(n int, kind byte, count int, id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dead[n] {
		return
	}
	c := t.byID[id]
	if c == nil {
		c = &poisonCounts{}
		t.byID[id] = c
	}
	open := t.open[n]
	if open == nil {
		open = map[string]int{}
		t.open[n] = open
	}
	switch kind {
	case 'd':
		if c.Deliveries == 0 {
			c.First = time.Now()
		}
		c.Deliveries++
		c.BrokerCount = max(c.BrokerCount, count)
		open[id]++
		t.last = time.Now()
	case 'a', 'n':
		if open[id] > 0 {
			open[id]--
		}
		if kind == 'a' {
			c.Acks++
		} else {
			c.Nacks++
		}
	}
}

// died records the death of consumer n: the deliveries it had not settled are lost.
func (t *tally) died(n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dead[n] {
		return
	}
	t.dead[n] = true
	for id, k := range t.open[n] {
		t.byID[id].Lost += k
	}
	delete(t.open, n)
}

// inFlight returns the deliveries that live consumers have not settled, and the time of the
// last delivery.
func (t *tally) inFlight() (int, time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, open := range t.open {
		for _, k := range open {
			n += k
		}
	}
	return n, t.last
}

func (t *tally) get(id string) poisonCounts {
	t.mu.Lock()
	defer t.mu.Unlock()
	if c := t.byID[id]; c != nil {
		return *c
	}
	return poisonCounts{}
}

func (t *tally) counts(ids ...string) map[string]poisonCounts {
	out := make(map[string]poisonCounts, len(ids))
	for _, id := range ids {
		out[id] = t.get(id)
	}
	return out
}

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
		child: consumerMainCalled.Load() && scheme(f.brokerURL) != "mem",
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
		Logger:              p.f.logger,
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
