package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// consumerGroup is the consumer group of every benchmark consumer: the AMQP queue of topic T
// is "T.bench", the Redis consumer group "bench".
const consumerGroup = "bench"

// cellTables are the tables of one cell, created fresh for it.
type cellTables struct {
	effects   string // the business table: one row per applied message, no unique key
	dedup     string // onceflow's dedup table
	processed string // the processed-messages table of the watermill baseline and the expert
}

func newCellTables(id string) cellTables {
	return cellTables{effects: "bench_effects_" + id, dedup: "bench_dedup_" + id, processed: "bench_processed_" + id}
}

func (t cellTables) create(ctx context.Context, db *sqldb.DB) error {
	blob := map[sqldb.Dialect]string{sqldb.Postgres: "BYTEA", sqldb.MySQL: "BLOB", sqldb.SQLite: "BLOB"}[db.Dialect]
	processed := `CREATE TABLE ` + t.processed + ` (id VARCHAR(255) NOT NULL PRIMARY KEY)`
	if db.Dialect == sqldb.MySQL {
		// The expert marks the rows its transaction inserts (expertSQL.record).
		processed = `CREATE TABLE ` + t.processed + ` (id VARCHAR(255) NOT NULL PRIMARY KEY, batch BIGINT NULL)`
	}
	for _, stmt := range []string{
		`CREATE TABLE ` + t.effects + ` (message_id VARCHAR(255) NOT NULL, payload ` + blob + ` NOT NULL)`,
		processed,
	} {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("%s: %w", stmt, err)
		}
	}
	return nil
}

func (t cellTables) drop(ctx context.Context, db *sqldb.DB) {
	for _, name := range []string{t.effects, t.dedup, t.processed} {
		_, _ = db.ExecContext(ctx, `DROP TABLE IF EXISTS `+name)
	}
}

// effectInsert is the business statement: one row with the message id and payload.
func effectInsert(db *sqldb.DB, table string) string {
	return db.Rebind(`INSERT INTO ` + table + ` (message_id, payload) VALUES (?, ?)`)
}

// dbURL returns the URL of the cell's database; the SQLite database is a file in dir.
func (s *suite) dbURL(st setup, dir string) string {
	switch st.Database {
	case "postgres":
		return s.pgURL
	case "mysql":
		return s.myURL
	}
	return "sqlite://" + filepath.Join(dir, "app.db")
}

// openDB opens the cell's database: a new pool, as a consumer process starting would.
func (s *suite) openDB(ctx context.Context, st setup, dir string) (*sqldb.DB, error) {
	db, err := sqldb.Open(ctx, s.dbURL(st, dir))
	if err != nil {
		return nil, err
	}
	if s.cfg.maxIdle > 0 {
		db.SetMaxIdleConns(s.cfg.maxIdle)
	}
	return db, nil
}

// brokerURL returns the URL of the cell's broker; the SQLite queue is a file in dir.
func (s *suite) brokerURL(st setup, dir string) string {
	switch st.Broker {
	case "amqp":
		return s.svc.amqp
	case "nats":
		return s.svc.nats
	case "redis":
		return s.svc.redis
	}
	return "sqlite://" + filepath.Join(dir, "queue.db")
}

// meter counts the effects committed and marks the commits that end the warm-up and the run;
// in the steady state it records the latency from publish to commit of each message sent after
// the warm-up. Every consumer tells it after each commit, of a batch or a message as it
// commits them: the expert and the watermill baseline after their own COMMIT, onceflow through
// its instruments (commits).
type meter struct {
	warm, target int64
	n            atomic.Int64 // effects committed
	settled      atomic.Int64 // deliveries acknowledged, duplicates included
	// The transactions committed: txns as the expert and the watermill baseline count them;
	// groups as onceflow's group-size histogram records them; processed, onceflow's messages
	// processed, each in a transaction of its own where no group ran (transactions).
	txns, groups, processed atomic.Int64
	// byGroup: onceflow's effects are counted by group (commits).
	byGroup atomic.Bool
	// In the reruns scenario, calls counts the processor's runs, one per message it is given,
	// and faults chooses the messages that fail; faults is nil elsewhere.
	calls          atomic.Int64
	faults         *faults
	warmAt, doneAt chan time.Time
	from           atomic.Int64 // Unix nanoseconds; messages sent from then on are timed (0: none)
	// atWarm and atDone, when set, run in the committing goroutine as the warm-up ends and the
	// last message commits, before warmAt and doneAt receive the time: the goroutine that
	// waits for those may be scheduled much later on a busy machine.
	atWarm, atDone func()

	mu       sync.Mutex
	lat      []float64 // milliseconds
	failures int64
	lastErr  error
}

func newMeter(warm, target int) *meter {
	return &meter{warm: int64(warm), target: int64(target), warmAt: make(chan time.Time, 1), doneAt: make(chan time.Time, 1)}
}

// transactions returns the transactions the consumer committed.
func (m *meter) transactions() int64 {
	if g := m.groups.Load(); g > 0 {
		return m.txns.Load() + g
	}
	return m.txns.Load() + m.processed.Load()
}

// committed records a commit of the effects of fresh, in a batch of settled deliveries.
func (m *meter) committed(fresh []inMsg, settled int) {
	m.txns.Add(1)
	now := time.Now()
	for _, f := range fresh {
		m.observe(now, f.sent)
	}
	m.add(now, len(fresh))
	m.settled.Add(int64(settled))
}

// committedGroup records the commit of one group of onceflow's, which committed the effects of
// n messages.
func (m *meter) committedGroup(n int) {
	if !m.byGroup.Load() {
		m.byGroup.Store(true)
	}
	m.groups.Add(1)
	m.add(time.Now(), n)
	m.settled.Add(int64(n))
}

// committedOne records the commit of one message's effect; sent is its headerSent value.
func (m *meter) committedOne(sent string) {
	now := time.Now()
	if sent != "" {
		ns, _ := strconv.ParseInt(sent, 10, 64)
		m.observe(now, ns)
	}
	m.add(now, 1)
	m.settled.Add(1)
}

func (m *meter) add(now time.Time, k int) {
	if k == 0 {
		return
	}
	after := m.n.Add(int64(k))
	before := after - int64(k)
	if before < m.warm && after >= m.warm {
		if m.atWarm != nil {
			m.atWarm()
		}
		m.warmAt <- now
	}
	if before < m.target && after >= m.target {
		if m.atDone != nil {
			m.atDone()
		}
		m.doneAt <- now
	}
}

func (m *meter) observe(now time.Time, sent int64) {
	from := m.from.Load()
	if from == 0 || sent < from {
		return
	}
	m.mu.Lock()
	m.lat = append(m.lat, float64(now.UnixNano()-sent)/1e6)
	m.mu.Unlock()
}

// fail records an error that a consumer recovered from (a batch given back, a read retried).
func (m *meter) fail(err error) {
	m.mu.Lock()
	m.failures++
	m.lastErr = err
	m.mu.Unlock()
}

func (m *meter) latencies() []float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.lat)
}

// commits is the MeterProvider of the router of an onceflow cell: it tells the cell's meter
// about each transaction that commits, as the expert tells it about each batch. With group
// commit that is each record of the group-size histogram, which the router makes after a
// group's commit with the number of messages it committed; where no group ran (the library's
// choice for the default variant), each message that the Metrics interceptor counts as
// processed, when the chain returns after its transaction's commit. The bench sees the commits
// without changing the handler's chain and without a goroutine per message. Every other
// instrument is a no-op, as with the global provider the router uses by default. A chain
// without the Metrics interceptor, or a renamed instrument, makes the cell time out rather than
// measure something else. sent is set when the messages carry their publish time in their
// context (sentRelay), in the steady state, whose latency is per message: each message is then
// counted on its own, by the Metrics interceptor, and the groups only as transactions.
// Elsewhere the counter does not look for it, which would walk the whole context chain of each
// message.
type commits struct {
	noop.MeterProvider
	m    *meter
	sent bool
}

func (p commits) Meter(string, ...metric.MeterOption) metric.Meter {
	return commitsMeter{m: p.m, sent: p.sent}
}

type commitsMeter struct {
	noop.Meter
	m    *meter
	sent bool
}

func (cm commitsMeter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	if name == telemetry.MetricMessages {
		return commitsCounter{m: cm.m, sent: cm.sent}, nil
	}
	return noop.Int64Counter{}, nil
}

func (cm commitsMeter) Int64Histogram(name string, _ ...metric.Int64HistogramOption) (metric.Int64Histogram, error) {
	if name == telemetry.MetricGroupSize {
		return groupTxns{m: cm.m, sent: cm.sent}, nil
	}
	return noop.Int64Histogram{}, nil
}

// groupTxns counts the transactions of a group-commit chain, one record each, and, unless
// sent, the effects each committed.
type groupTxns struct {
	noop.Int64Histogram
	m    *meter
	sent bool
}

func (g groupTxns) Record(_ context.Context, n int64, _ ...metric.RecordOption) {
	if g.sent {
		g.m.groups.Add(1)
		return
	}
	g.m.committedGroup(int(n))
}

type commitsCounter struct {
	noop.Int64Counter
	m    *meter
	sent bool
}

func (c commitsCounter) Add(ctx context.Context, incr int64, opts ...metric.AddOption) {
	if incr == 0 {
		return
	}
	attrs := metric.NewAddConfig(opts).Attributes()
	outcome, _ := attrs.Value(attribute.Key("onceflow.outcome"))
	if outcome.AsString() != string(processor.Processed) {
		c.m.settled.Add(incr) // a duplicate, or a failure that is not committed
		return
	}
	if !c.sent && c.m.byGroup.Load() {
		return // counted with its group's commit
	}
	var sent string
	if c.sent {
		sent, _ = ctx.Value(sentKey{}).(string)
	}
	c.m.processed.Add(incr)
	c.m.committedOne(sent)
}

// sentKey is the context key of a message's headerSent value.
type sentKey struct{}

// sentRelay passes on the messages of a Subscriber with their publish time (headerSent) in
// their context, where commitsCounter finds it. It is used in the steady state only: it costs
// a goroutine switch per message.
type sentRelay struct{ message.Subscriber }

func (r sentRelay) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := r.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range in {
			if sent := msg.Metadata.Get(headerSent); sent != "" {
				msg.SetContext(context.WithValue(msg.Context(), sentKey{}, sent))
			}
			select {
			case out <- msg:
			case <-ctx.Done():
				msg.Nack()
			}
		}
	}()
	return out, nil
}

// runE2E measures one variant of one setup at one concurrency in one scenario: it creates the
// cell's tables and topic, publishes its backlog (not measured) or starts publishing at the
// steady rate, runs the consumer, and checks at the end that the business table holds exactly
// one row per message.
func (s *suite) runE2E(ctx context.Context, cl cell, e *Entry) error {
	id := newID()
	dir := filepath.Join(s.svc.dir, id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	db, err := s.openDB(ctx, cl.st, dir)
	if err != nil {
		return err
	}
	defer db.Close()
	tables := newCellTables(id)
	if err := tables.create(ctx, db); err != nil {
		return err
	}
	defer tables.drop(context.WithoutCancel(ctx), db)
	t := topic{st: cl.st, brokerURL: s.brokerURL(cl.st, dir), name: "bench_" + id}
	if err := t.prepare(ctx); err != nil {
		return fmt.Errorf("create the topic: %w", err)
	}
	defer t.remove()

	steady := cl.scenario == scenarioSteady
	payload := s.payloads[cl.payload]
	var n, warm int
	if steady {
		n = max(int(cl.rate*(s.cfg.steadyWarmup+s.cfg.steadySeconds)), 1)
		e.OfferedRate = cl.rate
	} else {
		n = s.messagesFor(cl)
		warm = max(int(float64(n)*s.cfg.warmup), 1)
		e.Messages = n - warm
		if err := publishBacklog(ctx, t, n, payload); err != nil {
			return fmt.Errorf("publish: %w", err)
		}
	}

	m := newMeter(warm, n)
	if cl.scenario == scenarioReruns {
		m.faults = &faults{every: uint32(s.cfg.failEvery)}
	}
	// PostgreSQL's backends report their WAL counters when idle, at most once a second, and
	// when they exit: the counters are read around the whole cell, after its connections are
	// closed, and divided by all its messages.
	wal0 := serverWAL(ctx, db)
	rss0 := resetPeakRSS()
	profile := s.cfg.profileDir != "" && cl.c == slices.Max(s.cfg.concurrency)

	var t0, t1 time.Time
	var n0, n1 int64
	var cpu0, cpu1 cpuSample
	var prof *os.File
	var windowErr error
	startWindow := func() error {
		cpu0, n0 = sampleCPU(), m.n.Load()
		if profile {
			var err error
			prof, err = startProfile(s.cfg.profileDir, e.Name)
			writeAllocs(s.cfg.profileDir, e.Name, "start")
			return err
		}
		return nil
	}
	endWindow := func() {
		cpu1, n1 = sampleCPU(), m.n.Load()
		if prof != nil {
			pprof.StopCPUProfile()
			_ = prof.Close()
			writeAllocs(s.cfg.profileDir, e.Name, "end")
		}
	}
	if !steady {
		m.atWarm = func() { windowErr = startWindow() }
		m.atDone = endWindow
	}
	stop, err := s.startConsumer(ctx, cl, t, s.dbURL(cl.st, dir), db, tables, m)
	if err != nil {
		return fmt.Errorf("start consumer: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = stop()
		}
	}()
	timeout := time.Duration(float64(time.Second) * max(120, 10*float64(n)/guessRate(cl)))
	if steady {
		timeout = time.Duration(float64(time.Second) * (60 + 2*(s.cfg.steadyWarmup+s.cfg.steadySeconds)))
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	stuck := func() error {
		err := fmt.Errorf("%d of %d messages committed after %s", m.n.Load(), n, timeout)
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.lastErr != nil {
			err = fmt.Errorf("%w; last error (of %d): %w", err, m.failures, m.lastErr)
		}
		return err
	}
	if steady {
		// The clock starts after the warm-up and stops when the last message is published:
		// the window of the offered rate.
		start := time.Now()
		t0 = start.Add(time.Duration(s.cfg.steadyWarmup * float64(time.Second)))
		m.from.Store(t0.UnixNano())
		published := make(chan error, 1)
		pubCtx, cancelPub := context.WithCancel(ctx)
		defer cancelPub()
		go func() { published <- publishPaced(pubCtx, t, n, cl.rate, payload) }()
		select {
		case <-time.After(time.Until(t0)):
		case err := <-published:
			return fmt.Errorf("publish: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		}
		if err := startWindow(); err != nil {
			return err
		}
		select {
		case err := <-published:
			if err != nil {
				return fmt.Errorf("publish: %w", err)
			}
		case <-ctx.Done():
			return ctx.Err()
		}
		endWindow()
		// The commit rate is over the window as sampled, which starts when this goroutine
		// woke, maybe later than t0 on a busy machine.
		t0, t1 = cpu0.at, cpu1.at
		select {
		case <-m.doneAt:
		case <-deadline.C:
			return stuck()
		case <-ctx.Done():
			return ctx.Err()
		}
	} else {
		select {
		case t0 = <-m.warmAt:
		case <-deadline.C:
			return stuck()
		case <-ctx.Done():
			return ctx.Err()
		}
		select {
		case t1 = <-m.doneAt:
		case <-deadline.C:
			return stuck()
		case <-ctx.Done():
			return ctx.Err()
		}
		if windowErr != nil {
			return windowErr
		}
	}
	e.PeakRSSMiB, e.BaseRSSMiB = peakRSS(), rss0
	stopped = true
	if err := stop(); err != nil {
		return fmt.Errorf("stop consumer: %w", err)
	}

	elapsed := t1.Sub(t0).Seconds()
	if elapsed <= 0 {
		return fmt.Errorf("no time measured: the commit that ended the warm-up committed the last of the %d messages too (raise -min-messages)", n)
	}
	e.Seconds = round2(elapsed)
	if steady {
		lat := m.latencies()
		e.Messages = len(lat)
		e.MsgsPerS = float64(int(float64(n1-n0) / elapsed))
		e.LatencyP50Ms, e.LatencyP99Ms, e.LatencyMaxMs = percentile(lat, 0.50), percentile(lat, 0.99), percentile(lat, 1)
	} else {
		e.MsgsPerS = float64(int(float64(e.Messages) / elapsed))
	}
	e.CPU = cpuUse(cpu0, cpu1)
	e.CPUPerMsg = cpuPerMsg(e.CPU, cpu1.at.Sub(cpu0.at).Seconds(), int(n1-n0))
	e.ConnsClosedIdle = db.Stats().MaxIdleClosed
	e.CommitsPerMsg = perMsg(m.transactions(), n, 1000)
	switch {
	case wal0.ok:
		db.SetMaxIdleConns(0) // closes the consumer's connections: their backends report
		time.Sleep(100 * time.Millisecond)
		e.setWAL(wal0, serverWAL(ctx, db), n)
	case db.Dialect == sqldb.SQLite:
		// Under synchronous=FULL each commit syncs the file's WAL once (a checkpoint adds two).
		e.WALSyncsPerMsg = e.CommitsPerMsg
	}
	if m.faults != nil {
		calls, injected := m.calls.Load(), m.faults.injected()
		e.FailuresInjected = injected
		e.ProcessorCallsPerMsg = perMsg(calls, n, 10000)
		e.RerunsPer1000 = perMsg(1000*(calls-int64(n)-injected), n, 100)
	}
	m.mu.Lock()
	e.Failures = m.failures
	m.mu.Unlock()

	var got int
	if err := db.QueryRowxContext(ctx, `SELECT COUNT(*) FROM `+tables.effects).Scan(&got); err != nil {
		return err
	}
	// No unique key on the business table: a duplicate effect would be a row too many.
	if got != n {
		return fmt.Errorf("%d effects for %d messages", got, n)
	}
	return nil
}

// percentile returns the q-quantile of xs (nearest rank), rounded to 0.01; 0 for none.
func percentile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	xs = slices.Clone(xs)
	slices.Sort(xs)
	i := min(max(int(q*float64(len(xs))+0.5)-1, 0), len(xs)-1)
	return round2(xs[i])
}

// startConsumer starts the cell's consumer, on the database at dbURL, whose pool db the
// onceflow variants and the watermill baseline use; the returned function stops it.
func (s *suite) startConsumer(ctx context.Context, cl cell, t topic, dbURL string, db *sqldb.DB, tables cellTables, m *meter) (func() error, error) {
	switch cl.variant {
	case vExpert:
		// The expert's own pool: on MariaDB its connections take several statements at once.
		x, err := openExpertSQL(ctx, dbURL, tables, cl.c)
		if err != nil {
			return nil, err
		}
		var stop func() error
		switch cl.st.Broker {
		case "amqp":
			stop, err = startExpertAMQP(ctx, t, cl.c, x, m)
		case "nats":
			stop, err = startExpertNATS(ctx, t, cl.c, x, m)
		case "redis":
			stop, err = startExpertRedis(ctx, t, cl.c, x, m)
		default:
			stop, err = startExpertSQLite(ctx, t, cl.c, x, m)
		}
		if err != nil {
			return nil, errors.Join(err, x.close())
		}
		return func() error { return errors.Join(stop(), x.close()) }, nil
	case vBaseline:
		return s.startBaseline(ctx, cl, t, db, tables, m)
	}
	return s.startOnceflow(ctx, cl, t, db, tables, m)
}

func startProfile(dir, name string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	f, err := os.Create(filepath.Join(dir, "cpu-"+sanitize(name)+".pprof"))
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return f, nil
}

// writeAllocs writes the allocation profile of the process so far, at the start or the end of
// a profiled window: `go tool pprof -diff_base allocs-X-start.pprof allocs-X-end.pprof` shows
// what the window allocated.
func writeAllocs(dir, name, at string) {
	f, err := os.Create(filepath.Join(dir, "allocs-"+sanitize(name)+"-"+at+".pprof"))
	if err != nil {
		return
	}
	defer f.Close()
	_ = pprof.Lookup("allocs").WriteTo(f, 0)
}

func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c == '/' {
			b[i] = '_'
		}
	}
	return string(b)
}

// groupPending is the MaxAckPending of a NATS consumer that gives each of c subscriptions a
// window of p deliveries, for the watermill baseline and the expert, whose NATS consumers
// bound their unacknowledged deliveries as a whole; p elsewhere. onceflow's NATS subscriber,
// like every other broker's, takes Options.Prefetch per subscription.
func groupPending(st setup, p, c int) int {
	if st.Broker == "nats" {
		return p * c
	}
	return p
}

// startOnceflow starts an onceflow Router with one handler of the cell's variant, over the
// broker opened by URL (so that each scheme's own subscriber runs), with the cell's prefetch.
func (s *suite) startOnceflow(ctx context.Context, cl cell, t topic, db *sqldb.DB, tables cellTables, m *meter) (func() error, error) {
	var wait time.Duration
	if cl.scenario == scenarioSlow {
		wait = s.cfg.slowWait
	}
	// In the reruns scenario the processor counts its runs, and a message chosen by faults
	// fails its first run after its write, which the transaction rolls back.
	faults := m.faults
	var spec handlerSpec
	if cl.variant == vBatch {
		spec.batch = processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			if faults != nil {
				m.calls.Add(int64(len(msgs)))
			}
			if wait > 0 && !sleepCtx(ctx, wait) { // one remote call for the batch
				return ctx.Err()
			}
			tx, _ := middleware.CurrentTx(ctx)
			if err := insertEffects(ctx, tx, db.Dialect, tables.effects, len(msgs), func(i int) (string, []byte) {
				return msgs[i].ID, msgs[i].Payload
			}); err != nil {
				return err
			}
			if faults != nil {
				for _, msg := range msgs {
					if faults.fail(msg.ID) {
						return processor.ErrorFor(msg, errInjected)
					}
				}
			}
			return nil
		})
	} else {
		insert := effectInsert(db, tables.effects)
		spec.proc = processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if faults != nil {
				m.calls.Add(1)
			}
			if wait > 0 && !sleepCtx(ctx, wait) { // one remote call per message
				return ctx.Err()
			}
			tx, _ := middleware.CurrentTx(ctx)
			if _, err := tx.ExecContext(ctx, insert, msg.ID, msg.Payload); err != nil {
				return err
			}
			if faults.fail(msg.ID) {
				return errInjected
			}
			return nil
		})
	}
	b, err := broker.Open(ctx, t.brokerURL, broker.Options{ConsumerGroup: consumerGroup, Prefetch: cl.prefetch})
	if err != nil {
		return nil, err
	}
	sub, err := b.Subscriber()
	if err != nil {
		_ = b.Close()
		return nil, err
	}
	steady := cl.scenario == scenarioSteady
	if steady {
		sub = sentRelay{Subscriber: sub}
	}
	spec.meters = commits{m: m, sent: steady}
	stop, err := runRouter(ctx, sub, b.Publisher(), db, t.name, tables.dedup, cl.variant, cl.c, s.logger, spec)
	if err != nil {
		_ = b.Close()
		return nil, err
	}
	return func() error { return errors.Join(stop(), b.Close()) }, nil
}

// handlerSpec is what a handler applies, a per-message processor or a batch processor, and
// the router's MeterProvider (nil: the global one).
type handlerSpec struct {
	proc   processor.Processor
	batch  processor.Batch
	meters metric.MeterProvider
}

// qosOf returns the quality of service of an onceflow variant, and whether the bench turns
// group commit on for it (the default variant leaves that to the library).
func qosOf(v string) (onceflow.QoS, bool) {
	switch v {
	case vAtLeastOnce:
		return onceflow.AtLeastOnce, false
	case vGroupCommit, vBatch:
		return onceflow.ExactlyOnce, true
	}
	return onceflow.ExactlyOnce, false
}

// startRouter runs a Router with the handler "bench" on a new subscriber of b, applying p,
// until the returned stop is called.
func startRouter(ctx context.Context, b *broker.Broker, db *sqldb.DB, topic, dedupTable, v string, c int, logger *slog.Logger, p processor.Processor) (func() error, error) {
	sub, err := b.Subscriber()
	if err != nil {
		return nil, err
	}
	return runRouter(ctx, sub, b.Publisher(), db, topic, dedupTable, v, c, logger, handlerSpec{proc: p})
}

// runRouter runs a Router with the handler "bench" of variant v on sub until the returned stop
// is called. Everything but the variant's choices is left at onceflow's defaults: the default
// variant sets nothing but Concurrency (and the cell's dedup table, which keeps cells apart).
func runRouter(ctx context.Context, sub message.Subscriber, dead message.Publisher, db *sqldb.DB, topic, dedupTable, v string, c int, logger *slog.Logger, spec handlerSpec) (func() error, error) {
	r, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: dead,
		DeadLetterTopic:     topic + "_dead",
		Logger:              logger,
		MeterProvider:       spec.meters,
		PurgeInterval:       -1,
		CloseTimeout:        10 * time.Second,
	})
	if err != nil {
		return nil, err
	}
	qos, group := qosOf(v)
	h := onceflow.Handler{
		Name:           "bench",
		Topic:          topic,
		Subscriber:     sub,
		Processor:      spec.proc,
		BatchProcessor: spec.batch,
		QoS:            qos,
		DB:             db,
		Concurrency:    c,
		Dedup:          middleware.Dedup{Table: dedupTable},
	}
	if v != vDefault {
		h.GroupCommit.Disabled = !group
	}
	if err := r.AddHandler(h); err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	select {
	case <-r.Running():
	case err := <-done:
		cancel()
		return nil, fmt.Errorf("router stopped before running: %w", err)
	}
	return func() error {
		cancel()
		return <-done
	}, nil
}

// publishAMQP declares the topology onceflow uses for topic on RabbitMQ and publishes n
// persistent messages, waiting for every publisher confirm (the memory benchmark's publisher).
func publishAMQP(ctx context.Context, amqpURL, name string, n int, payload []byte) error {
	t := topic{st: setup{Broker: "amqp"}, brokerURL: amqpURL, name: name}
	if err := t.prepare(ctx); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	return publishBacklog(ctx, t, n, payload)
}
