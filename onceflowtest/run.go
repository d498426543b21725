package onceflowtest

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"golang.org/x/term"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/sqlitequeue" // the embedded default's queue
	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/sqlite" // the embedded default's database
)

// Run runs the handler of cfg under faults, in consumer processes that cfg.Command starts, and
// reports what became of each message. It returns an error when the run could not be made (a
// service unreachable, a handler that does not validate); a handler that is not exactly-once
// is a Report whose Err says why. Prove is Run for a test.
func Run(ctx context.Context, cfg Config) (Report, error) {
	if err := cfg.validate(); err != nil {
		return Report{}, err
	}
	if len(cfg.Command) == 0 {
		return Report{}, errors.New("onceflowtest: Config.Command: empty (Run needs the command of a consumer process, a program that calls Consume; Prove makes it from the test binary)")
	}
	cfg = cfg.withDefaults()
	keep := cfg.Dir != ""
	if !keep {
		dir, err := os.MkdirTemp("", "onceflowtest-")
		if err != nil {
			return Report{}, err
		}
		defer os.RemoveAll(dir)
		cfg.Dir = dir
	}
	r, err := run(ctx, cfg, testCall{})
	if keep {
		r.Logs = cfg.Dir
	}
	return r, err
}

// testCall names a call of Prove: the test, and the number of the call in it; zero under Run.
type testCall struct {
	name string
	n    int
}

// handlerInfo is what a run needs to know of the handler under test.
type handlerInfo struct {
	name, topic string
	qos         onceflow.QoS
	chain       onceflow.Chain
	// dedup: the chain holds the built-in duplicate detection; recordsIDs: it records each
	// message id (by id or check-first, or the in-order stage); republished: it tells a second
	// publish of an id from a new message (not by offset, nor by the queue's acknowledgement).
	dedup, recordsIDs, republished bool
	// deadLetters: the chain holds the dead-letter stage; inOrder: the in-order stage.
	deadLetters, inOrder bool
}

// inspect builds the handler of cfg in the run's own process, checks that it takes the
// subscriber and database the run gives it, validates it and creates its tables
// (Router.Migrate), and returns what the run needs to know of it.
func inspect(ctx context.Context, cfg Config, db *sqldb.DB, b *broker.Broker) (handlerInfo, error) {
	sub, err := b.Subscriber()
	if err != nil {
		return handlerInfo{}, err
	}
	defer sub.Close()
	h := cfg.Handler(Env{Subscriber: sub, Publisher: b.Publisher(), DB: db, Consumer: -1})
	if cfg.Topic != "" {
		h.Topic = cfg.Topic
	}
	switch {
	case h.Subscriber != sub:
		return handlerInfo{}, errors.New("onceflowtest: Handler.Subscriber: not the Env's Subscriber (the run delivers the messages through it)")
	case h.DB != db:
		return handlerInfo{}, errors.New("onceflowtest: Handler.DB: not the Env's DB (the run gives the handler its database, through its proxy)")
	}
	dlq := cfg.DeadLetterTopic
	if dlq == "" {
		dlq = h.Topic + "_dlq"
	}
	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher(), DeadLetterTopic: dlq, PurgeInterval: -1, Logger: cfg.Logger})
	if err != nil {
		return handlerInfo{}, err
	}
	if err := router.AddHandler(h); err != nil {
		return handlerInfo{}, fmt.Errorf("onceflowtest: the handler under test: %w", err)
	}
	if err := router.Migrate(ctx); err != nil {
		return handlerInfo{}, fmt.Errorf("onceflowtest: create the handler's tables: %w", err)
	}
	c := h.Chain
	if c.QoS() == 0 {
		c = h.QoS.Chain()
	}
	names := c.Names()
	has := func(s onceflow.StageName) bool { return slices.Contains(names, s) }
	byPosition := h.Dedup.Mode == middleware.DedupByOffset || h.Dedup.Mode == middleware.DedupAckInTransaction
	info := handlerInfo{
		name: h.Name, topic: h.Topic, qos: c.QoS(), chain: c,
		dedup:       has(onceflow.StageDeduplicate),
		deadLetters: has(onceflow.StageDeadLetter),
		inOrder:     has(onceflow.StageInOrder),
	}
	info.recordsIDs = info.inOrder || info.dedup && !byPosition && h.Dedup.Mode != middleware.DedupNatural
	info.republished = !(info.dedup && byPosition)
	if info.inOrder {
		if err := ordercheck.Create(ctx, db, appliedTable); err != nil {
			return handlerInfo{}, err
		}
	}
	return info, nil
}

func newRunID() string {
	var b [6]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// runner is one run.
type runner struct {
	cfg    Config
	info   handlerInfo
	db     *sqldb.DB
	runID  string
	msgs   []Message
	good   map[string]int // each good message's number, by id
	dups   map[int]bool   // the messages published twice, by number
	faults map[string]fault
	poison *poisonSet
	dead   *deadLetters
	pool   *pool
	cuts   []cut
	report Report
	// lastOut is when the last progress line went out.
	lastOut time.Time
	// ackTimeout is how long after a consumer's death the messages it held come back.
	ackTimeout time.Duration
}

// cut is a connection cut, for the accounts.
type cut struct {
	at      time.Duration
	service string
}

// run runs cfg, whose defaults are set, for the call of Prove test (zero under Run).
func run(ctx context.Context, cfg Config, test testCall) (Report, error) {
	if cfg.BrokerURL == "" {
		cfg.BrokerURL = "sqlite://" + filepath.Join(cfg.Dir, "queue.db")
	}
	if cfg.DBURL == "" {
		cfg.DBURL = "sqlite://" + filepath.Join(cfg.Dir, "app.db")
	}
	if strings.HasPrefix(cfg.BrokerURL, "mem:") {
		return Report{}, errors.New("onceflowtest: Config.BrokerURL: a mem:// broker lives in one process, and the run's consumers are processes of their own")
	}
	db, err := sqldb.Open(ctx, cfg.DBURL)
	if err != nil {
		return Report{}, err
	}
	defer db.Close()
	b, err := broker.Open(ctx, cfg.BrokerURL, brokerOptions())
	if err != nil {
		return Report{}, err
	}
	defer b.Close()
	if cfg.Setup != nil {
		if err := cfg.Setup(ctx, db); err != nil {
			return Report{}, fmt.Errorf("onceflowtest: Config.Setup: %w", err)
		}
	}
	info, err := inspect(ctx, cfg, db, b)
	if err != nil {
		return Report{}, err
	}
	if cfg.Name == "" {
		cfg.Name = info.name
	}
	cfg.Topic = info.topic
	if cfg.DeadLetterTopic == "" {
		cfg.DeadLetterTopic = info.topic + "_dlq"
	}
	r := &runner{cfg: cfg, info: info, db: db, runID: newRunID(), faults: map[string]fault{}, dups: map[int]bool{},
		ackTimeout: ackTimeout(cfg.BrokerURL)}
	r.report = Report{
		Handler: info.name, QoS: info.qos.String(), Chain: info.chain.String(),
		Broker: b.String(), Database: db.String(), Seed: cfg.Seed, Messages: cfg.Messages,
		CrashPoints: map[CrashPoint]int{},
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
	if err := r.makeMessages(); err != nil {
		return r.report, err
	}
	dups := r.chooseFaults(rng)
	r.poison = newPoison(cfg.Poison, info, r.runID, r.msgs[0], b.Publisher(), r.faults)
	if r.poison != nil {
		r.report.Poison = r.poison.res
	}
	faultsFile := filepath.Join(cfg.Dir, "faults-"+r.runID+".json")
	if err := writeJSON(faultsFile, r.faults); err != nil {
		return r.report, err
	}

	px, brokerURL, dbURL, err := newProxies(cfg.BrokerURL, cfg.DBURL)
	if err != nil {
		return r.report, err
	}
	defer px.close()
	if !px.cuttable() && cfg.Cuts > 0 {
		r.report.Left = append(r.report.Left, "connection cuts: the embedded queue and database have no connection to cut")
	}
	if info.deadLetters {
		r.dead, err = collectDeadLetters(ctx, b, cfg.DeadLetterTopic, info.name, r.mine)
		if err != nil {
			return r.report, err
		}
		defer r.dead.stop()
	}
	r.pool = &pool{
		command: cfg.Command, dir: cfg.Dir, logger: cfg.Logger, started: time.Now(),
		base: spec{Test: test.name, Call: test.n, Topic: cfg.Topic, Broker: brokerURL, DB: dbURL, DeadLetterTopic: cfg.DeadLetterTopic, Faults: faultsFile, Run: r.runID, Order: info.inOrder},
	}
	defer r.pool.stopAll()
	if err := r.loop(ctx, b, px, dups, rng); err != nil {
		return r.report, err
	}
	return r.report, r.tally(ctx)
}

// makeMessages makes the run's good messages.
func (r *runner) makeMessages() error {
	n := r.cfg.Messages
	r.msgs = make([]Message, n)
	r.good = make(map[string]int, n)
	for i := range n {
		m := r.cfg.Message(i)
		if m.ID == "" {
			m.ID = fmt.Sprintf("%s-%06d", r.runID, i)
		}
		if r.info.inOrder && m.Key == "" {
			m.Key, m.Sequence = fmt.Sprintf("%s-key-%03d", r.runID, i%r.cfg.Keys), uint64(i/r.cfg.Keys+1)
		}
		if j, ok := r.good[m.ID]; ok {
			return fmt.Errorf("onceflowtest: Config.Message: messages %d and %d have the same id %q", j, i, m.ID)
		}
		r.good[m.ID] = i
		r.msgs[i] = m
	}
	return nil
}

// chooseFaults picks the messages that get a failure or a panic at their first attempt, and
// returns those published twice.
func (r *runner) chooseFaults(rng *rand.Rand) (dups []int) {
	n := r.cfg.Messages
	picked := rng.Perm(n)
	for _, i := range picked[:r.cfg.Failures] {
		r.faults[r.msgs[i].ID] = faultFailOnce
	}
	for _, i := range picked[r.cfg.Failures:min(n, r.cfg.Failures+r.cfg.Panics)] {
		r.faults[r.msgs[i].ID] = faultPanicOnce
	}
	r.report.Failures = r.cfg.Failures
	r.report.Panics = min(n, r.cfg.Failures+r.cfg.Panics) - r.cfg.Failures
	if r.cfg.Duplicates > 0 && !r.info.republished {
		r.report.Left = append(r.report.Left, "duplicate publishes: the handler detects duplicates by position, and takes a second publish of an id for a new message")
		return nil
	}
	dups = rng.Perm(n)[:r.cfg.Duplicates]
	r.report.Duplicates = len(dups)
	for _, i := range dups {
		r.dups[i] = true
	}
	return dups
}

// mine reports whether id is one of the run's messages.
func (r *runner) mine(id string) bool {
	if _, ok := r.good[id]; ok {
		return true
	}
	if r.poison != nil {
		_, ok := r.poison.names[id]
		return ok
	}
	return false
}

// loop starts the consumers, publishes, injects the faults, and returns once every message has
// an effect and every poison message a dead letter, with every fault done and nothing changed
// for Settle; or once nothing changed for Stall.
func (r *runner) loop(ctx context.Context, b *broker.Broker, px *proxies, dups []int, rng *rand.Rand) error {
	cfg := r.cfg
	for i := range cfg.Consumers {
		var c *crash
		if r.poison != nil {
			// The first dead letter each first consumer publishes kills it.
			c = &crash{Point: DeadLetterPublish, N: 1}
		}
		if err := r.pool.restart(ctx, i, c, &r.report); err != nil {
			return err
		}
	}
	published := len(r.msgs) + len(dups)
	if r.poison != nil {
		published += r.poison.res.Published
		if r.poison.crash != nil {
			if err := b.Publisher().Publish(r.info.topic, r.poison.crash); err != nil {
				return fmt.Errorf("onceflowtest: publish the crash-loop message: %w", err)
			}
			time.Sleep(crashLoopGap)
		}
	}
	// Messages are published while the consumers run and the faults come, as in production:
	// the first kill may land before the last message is published.
	started := time.Now()
	publishDone := make(chan error, 1)
	order := publishOrder(len(r.msgs), dups, rng)
	go func() {
		var others []*message.Message
		if r.poison != nil {
			others = r.poison.others
		}
		publishDone <- publish(b.Publisher(), r.info.topic, r.msgs, order, others, cfg.PublishOver)
	}()
	publishing := true

	// Faults are placed by progress, evenly over the run: a kill each Messages/(Kills+1)
	// deliveries, and likewise a cut.
	killsDone, cutsDone, crashTurn := 0, 0, 0
	cuts := cfg.Cuts
	if !px.cuttable() {
		cuts = 0
	}
	lastTotal, lastChange, lastEffect, lastFault := -1, time.Now(), started, time.Now()
	var distinct int
	var nextPoll time.Time
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		if publishing {
			select {
			case err := <-publishDone:
				if err != nil {
					return fmt.Errorf("onceflowtest: publish: %w", err)
				}
				publishing = false
			default:
			}
		}
		if time.Now().After(nextPoll) {
			nextPoll = time.Now().Add(250 * time.Millisecond)
			effects, err := r.effects(ctx)
			if err != nil {
				return err
			}
			total := 0
			distinct = 0
			for id, n := range effects {
				total += n
				if _, ok := r.good[id]; ok {
					distinct++
				}
			}
			if total != lastTotal {
				lastTotal, lastChange, lastEffect = total, time.Now(), time.Now()
			}
		}
		poisonDone := true
		if r.dead != nil {
			if last := r.dead.changed(); last.After(lastChange) {
				lastChange = last
			}
			if r.poison != nil {
				poisonDone = r.dead.done(r.poison)
			}
		}
		r.progress(distinct, killsDone+r.crashKills(), cutsDone)

		// Consumers that died on their own: an armed crash point fired, the crash-loop
		// message, or an error.
		for _, ev := range r.pool.reap() {
			// A consumer that did not die at its armed crash point restarts armed with it.
			arm := ev.crash
			switch {
			case ev.poisoned:
				r.report.Poison.Kills++
			case ev.crashed:
				r.report.countCrash(ev.crash.Point)
				arm = nil
			}
			lastFault = time.Now()
			if err := r.pool.restart(ctx, ev.id, arm, &r.report); err != nil {
				return err
			}
		}

		// Faults are placed by deliveries rather than effects, so that they keep coming for
		// a handler that loses effects.
		deliveries := r.pool.deliveries()
		progress := max(min(deliveries, cfg.Messages), distinct)
		if id, ok := r.pool.pick(rng); ok && killsDone < cfg.Kills && progress >= cfg.Messages*(killsDone+1)/(cfg.Kills+1) {
			// Kill a consumer at a random moment, and let its successor die at a crash point:
			// the next in turn, or the one the killed consumer had not reached yet, so that
			// a run whose kills come close together still reaches after-commit first.
			c := r.pool.kill(id)
			killsDone++
			r.report.Kills++
			lastFault = time.Now()
			if c == nil || c.Point == DeadLetterPublish {
				c = &crash{Point: CrashPoints[crashTurn%len(CrashPoints)], N: 1 + rng.IntN(5)}
				crashTurn++
			}
			if err := r.pool.restart(ctx, id, c, &r.report); err != nil {
				return err
			}
		}
		if cutsDone < cuts && progress >= cfg.Messages*(cutsDone+1)/(cuts+1) {
			service, err := px.cut(cutsDone)
			if err != nil {
				return fmt.Errorf("cut connections: %w", err)
			}
			r.cuts = append(r.cuts, cut{at: time.Since(r.pool.started), service: service})
			cfg.Logger.Info("connections cut", "service", service, "run", cfg.Name)
			cutsDone++
			lastFault = time.Now()
		}

		quiet := time.Since(lastChange)
		faultsDone := killsDone == cfg.Kills && cutsDone == cuts && !publishing
		// A message held by a consumer that died comes back after the broker's ack timeout: it
		// may yet be applied again.
		settled := quiet >= cfg.Settle && time.Since(lastFault) >= cfg.Settle+r.ackTimeout
		switch {
		case distinct == cfg.Messages && faultsDone && poisonDone && settled && deliveries >= published:
		case quiet >= cfg.Stall:
			// Nothing changes any more and messages are missing: they are lost.
		case r.info.qos == onceflow.BestEffort && !publishing && settled:
			// BestEffort loses messages, so progress may never reach the last faults' marks.
		default:
			continue
		}
		break
	}
	r.report.Cuts = cutsDone
	if elapsed := lastEffect.Sub(started).Seconds(); elapsed > 0 {
		r.report.MsgsPerSec = float64(distinct) / elapsed
	}
	if cfg.Progress != nil {
		fmt.Fprintln(cfg.Progress)
	}
	return nil
}

func (r *runner) crashKills() int {
	n := 0
	for _, v := range r.report.CrashPoints {
		n += v
	}
	return n
}

// effects returns the number of effects of each of the run's messages that has one.
func (r *runner) effects(ctx context.Context) (map[string]int, error) {
	rows, err := r.db.QueryContext(ctx, r.cfg.Effects)
	if err != nil {
		return nil, fmt.Errorf("onceflowtest: Config.Effects: %w", err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int64
		if err := rows.Scan(&id, &n); err != nil {
			return nil, fmt.Errorf("onceflowtest: Config.Effects: want two columns, a message id and a count: %w", err)
		}
		if r.mine(id) {
			out[id] += int(n)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("onceflowtest: Config.Effects: %w", err)
	}
	return out, nil
}

// tally counts what became of each message, once the consumers have stopped.
func (r *runner) tally(ctx context.Context) error {
	r.pool.stopAll()
	var goodDead []string
	if r.dead != nil {
		r.dead.stop()
		goodDead = r.dead.tally(r.poison)
	}
	effects, err := r.effects(ctx)
	if err != nil {
		return err
	}
	accounts := map[string]*Account{}
	note := func(id, problem string) {
		if a := accounts[id]; a != nil {
			a.Problem += "; " + problem
			return
		}
		accounts[id] = &Account{ID: id, Problem: problem}
	}
	for _, m := range r.msgs {
		switch n := effects[m.ID]; {
		case n == 0:
			r.report.Lost++
			note(m.ID, "lost: no effect")
		case n > 1:
			r.report.Duplicated++
			note(m.ID, fmt.Sprintf("applied %d times", n))
		}
	}
	for _, id := range goodDead {
		note(id, "dead-lettered, though it can succeed: "+r.dead.reason(id))
	}
	if r.poison != nil {
		for id, name := range r.poison.names {
			if n := effects[id]; n > 0 {
				r.poison.res.Applied++
				note(id, fmt.Sprintf("poison message %q applied %d times, though it cannot succeed", name, n))
			}
			switch k := r.poison.res.Kinds[name]; {
			case k == 0:
				note(id, fmt.Sprintf("poison message %q never dead-lettered", name))
			}
		}
	}
	if r.info.inOrder {
		want := map[string]uint64{}
		for _, m := range r.msgs {
			want[m.Key]++
		}
		res, err := ordercheck.Tally(ctx, r.db, appliedTable, r.runID, want)
		if err != nil {
			return err
		}
		late := len(res.Late)
		r.report.OutOfOrder = &late
		for _, l := range res.Late {
			note(l.MessageID, fmt.Sprintf("applied out of order: sequence %d of key %q after sequence %d", l.Seq, l.Key, l.After))
		}
	}
	ids := make([]string, 0, len(accounts))
	for id := range accounts {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		a := accounts[id]
		a.Events, a.Cause = r.explain(id, a.Problem, effects[id])
		r.report.Accounts = append(r.report.Accounts, *a)
	}
	return nil
}

// progress writes a progress line every 5 s, or rewrites it in place every 250 ms on a
// terminal.
func (r *runner) progress(distinct, kills, cuts int) {
	if r.cfg.Progress == nil {
		return
	}
	every, prefix, suffix := 5*time.Second, "", "\n"
	if r.tty() {
		every, prefix, suffix = 250*time.Millisecond, "\r", "   "
	}
	if time.Since(r.lastOut) < every {
		return
	}
	r.lastOut = time.Now()
	fmt.Fprintf(r.cfg.Progress, "%s%-18s %6d/%d messages with an effect, %d kills, %d connection cuts%s",
		prefix, r.cfg.Name, distinct, r.cfg.Messages, kills, cuts, suffix)
}

func (r *runner) tty() bool {
	f, ok := r.cfg.Progress.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// ackTimeout returns the ack timeout of the broker at brokerURL: its ack_timeout parameter,
// which broker.Open has checked, or the run's.
func ackTimeout(brokerURL string) time.Duration {
	if u, err := url.Parse(brokerURL); err == nil {
		if d, err := time.ParseDuration(u.Query().Get("ack_timeout")); err == nil {
			return d
		}
	}
	return brokerOptions().AckTimeout
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}
