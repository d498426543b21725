package verify

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/term"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/sqldb"
)

// runMode measures one mode.
func runMode(ctx context.Context, cfg Config, db *sqldb.DB, b *broker.Broker, mode Mode, rng *rand.Rand) (Result, error) {
	runID := newRunID()
	name := strings.ToLower(mode.String())
	// A batch processor implies group commit.
	groupCommit := mode.Batch || (cfg.GroupCommit && mode.exactlyOnce())
	if groupCommit && !mode.Batch {
		name += "_gc"
	}
	res := Result{Mode: mode.String(), Messages: cfg.Messages, Duplicates: cfg.Duplicates, CrashPoints: map[CrashPoint]int{}}
	res.Expected, _ = expectation(mode)

	px, brokerURL, dbURL, err := newProxies(cfg.BrokerURL, cfg.DBURL)
	if err != nil {
		return res, err
	}
	defer px.close()

	pool := &pool{
		cfg: cfg, mode: mode, groupCommit: groupCommit, runID: runID,
		topic: "onceflow_verify_" + name, handler: "verify_" + name + "_" + runID, deadLetterTopic: "onceflow_verify_" + name + "_dlq",
		brokerURL: brokerURL, dbURL: dbURL,
	}
	poison := newPoison(cfg, mode, runID, b.Publisher(), pool.topic)
	var dead *deadLetters
	if poison != nil {
		res.Poison = poison.res
		if dead, err = collectDeadLetters(ctx, b, pool.deadLetterTopic, runID); err != nil {
			return res, err
		}
		defer dead.stop()
	}
	defer pool.stopAll()
	for i := range cfg.Consumers {
		if err := pool.restart(ctx, i, nil, &res); err != nil {
			return res, err
		}
	}
	if poison != nil && poison.crash != nil {
		if err := b.Publisher().Publish(pool.topic, poison.crash); err != nil {
			return res, fmt.Errorf("publish the crash-loop message: %w", err)
		}
		time.Sleep(crashLoopGap)
	}
	// Messages are published while the consumers run and the faults are injected, as in
	// production: the first kill may land before the last message is published.
	started := time.Now()
	published := make(chan error, 1)
	pubRng := rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64()))
	go func() {
		keys := 0
		if mode == ExactlyOnceInOrder {
			keys = cfg.Keys
		}
		var others []*message.Message
		if poison != nil {
			others = poison.others
		}
		published <- publish(b.Publisher(), pool.topic, runID, cfg.Messages, cfg.Duplicates, keys, others, pubRng)
	}()
	publishing := true

	// Faults are placed by progress, evenly over the run: a kill each Messages/(Kills+1)
	// processed messages, and likewise a cut.
	// The crash points take turns from after-commit, the window that tells AtLeastOnce from
	// ExactlyOnce, so that even a short run arms it.
	killsDone, cutsDone, crashTurn := 0, 0, slices.Index(CrashPoints, AfterCommit)
	cuts := cfg.Cuts
	if !px.cuttable() {
		cuts = 0
	}
	var distinct, total int
	lastTotal, lastChange, lastEffect := -1, time.Now(), started
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-tick.C:
		}
		if publishing {
			select {
			case err := <-published:
				if err != nil {
					return res, fmt.Errorf("publish: %w", err)
				}
				publishing = false
			default:
			}
		}
		if distinct, total, err = counts(ctx, db, runID); err != nil {
			return res, err
		}
		if total != lastTotal {
			lastTotal, lastChange, lastEffect = total, time.Now(), time.Now()
		}
		poisonDone := true
		if dead != nil {
			if last := dead.changed(); last.After(lastChange) {
				lastChange = last
			}
			poisonDone = dead.done(poison)
		}
		pool.reportProgress(cfg, mode, distinct, killsDone+res.crashKills(), cutsDone)

		// Consumers that died on their own: an armed crash point fired, or an error.
		for _, ev := range pool.reap() {
			switch {
			case ev.poisoned:
				res.Poison.Kills++
			case ev.crashed:
				res.countCrash(ev.crash.Point)
			}
			if err := pool.restart(ctx, ev.id, nil, &res); err != nil {
				return res, err
			}
		}

		// Faults are placed by deliveries rather than effects, so that they keep coming in a
		// mode that loses effects.
		progress := int(min(pool.deliveries(), int64(cfg.Messages)))
		progress = max(progress, distinct)
		if id, ok := pool.pick(rng); ok && killsDone < cfg.Kills && progress >= cfg.Messages*(killsDone+1)/(cfg.Kills+1) {
			// Kill a consumer at a random moment, and let its successor die at a crash point.
			pool.kill(id)
			killsDone++
			res.Kills++
			crash := &Crash{Point: CrashPoints[crashTurn%len(CrashPoints)], N: 1 + rng.IntN(5)}
			crashTurn++
			if err := pool.restart(ctx, id, crash, &res); err != nil {
				return res, err
			}
		}
		if cutsDone < cuts && progress >= cfg.Messages*(cutsDone+1)/(cuts+1) {
			service := px.cut(cutsDone)
			cfg.Logger.Info("connections cut", "service", service, "mode", mode.String())
			cutsDone++
		}

		quiet := time.Since(lastChange)
		faultsDone := killsDone == cfg.Kills && cutsDone == cuts && !publishing
		switch {
		case distinct == cfg.Messages && faultsDone && poisonDone && quiet >= cfg.Settle:
		case quiet >= cfg.Stall:
			// Nothing changes any more and messages are missing: they are lost.
		case mode == BestEffort && !publishing && quiet >= cfg.Settle:
			// BestEffort loses messages, so progress may never reach the last faults' marks.
		default:
			continue
		}
		break
	}
	res.Cuts = cutsDone
	pool.stopAll()
	if cfg.Progress != nil {
		fmt.Fprintln(cfg.Progress)
	}
	if dead != nil {
		dead.stop()
		dead.tally(poison)
	}

	lost, duplicated, err := tally(ctx, db, runID, cfg.Messages)
	if err != nil {
		return res, err
	}
	res.Lost, res.Duplicated = lost, duplicated
	violations := 0
	if mode == ExactlyOnceInOrder {
		order, err := ordercheck.Tally(ctx, db, appliedTable, runID, wantSequences(cfg.Messages, cfg.Keys))
		if err != nil {
			return res, err
		}
		violations = order.OutOfOrder
		res.OrderViolations = &violations
		if order.First != "" {
			cfg.Logger.Warn("ordering", "mode", mode.String(), "first_violation", order.First)
		}
	}
	if elapsed := lastEffect.Sub(started).Seconds(); elapsed > 0 {
		res.MsgsPerSec = float64(distinct) / elapsed
	}
	res.Verdict, res.OK = verdict(mode.QoS, lost, duplicated, violations)
	if !res.Poison.held() && mode.QoS != BestEffort.QoS {
		res.Verdict += fmt.Sprintf("; FAIL: %d of %d poison messages dead-lettered (%d of them twice), and %d good ones",
			res.Poison.DeadLettered, res.Poison.Published, res.Poison.Twice, res.Poison.GoodDeadLettered)
		res.OK = false
	}
	return res, nil
}

func (r *Result) countCrash(p CrashPoint) {
	r.Kills++
	r.CrashPoints[p]++
}

func (r *Result) crashKills() int {
	n := 0
	for _, v := range r.CrashPoints {
		n += v
	}
	return n
}

// counts returns the number of the run's message ids with an effect, and the number of their
// effects. Messages of earlier runs still on the topic (a run that was interrupted leaves them)
// are processed too, and ignored here by their id prefix.
func counts(ctx context.Context, db *sqldb.DB, runID string) (distinct, total int, err error) {
	err = db.QueryRowxContext(ctx, db.Rebind(`SELECT COUNT(DISTINCT message_id), COUNT(*) FROM `+effectsTable+
		` WHERE run_id = ? AND message_id LIKE ?`), runID, runID+"-%").Scan(&distinct, &total)
	return distinct, total, err
}

// tally counts lost messages (no effect) and duplicated ones (more than one effect).
func tally(ctx context.Context, db *sqldb.DB, runID string, n int) (lost, duplicated int, err error) {
	distinct, _, err := counts(ctx, db, runID)
	if err != nil {
		return 0, 0, err
	}
	err = db.GetContext(ctx, &duplicated, db.Rebind(`SELECT COUNT(*) FROM (SELECT message_id FROM `+effectsTable+
		` WHERE run_id = ? AND message_id LIKE ? GROUP BY message_id HAVING COUNT(*) > 1) d`), runID, runID+"-%")
	return n - distinct, duplicated, err
}

// expectation returns the delivery-guarantee table's entry for a persistent broker in mode's
// column (docs/background.md).
func expectation(m Mode) (string, bool) {
	switch {
	case m.Batch:
		return "exactly once (batch processor)", true
	case m.Dedup == DedupByOffset:
		return "exactly once (offsets in the transaction)", true
	case m.Dedup == DedupAckInTx:
		return "exactly once (ack in the transaction)", true
	}
	switch m.QoS {
	case onceflow.BestEffort:
		return "maybe (lost on consumer crash)", false
	case onceflow.AtLeastOnce:
		return "at least once (duplicates)", false
	case onceflow.ExactlyOnceInOrder:
		return "exactly once, in order per key", true
	}
	return "exactly once", true
}

func verdict(mode onceflow.QoS, lost, duplicated, orderViolations int) (string, bool) {
	switch mode {
	case onceflow.BestEffort:
		if lost > 0 {
			return fmt.Sprintf("as promised: %d lost", lost), true
		}
		return "no loss this run: the faults missed the window between ack and commit", true
	case onceflow.AtLeastOnce:
		if lost > 0 {
			return fmt.Sprintf("FAIL: %d lost", lost), false
		}
		if duplicated > 0 {
			return fmt.Sprintf("as promised: nothing lost, %d duplicated", duplicated), true
		}
		return "nothing lost; no duplicate this run", true
	}
	if mode == onceflow.ExactlyOnceInOrder {
		if lost == 0 && duplicated == 0 && orderViolations == 0 {
			return "PASS: exactly once, in order", true
		}
		return fmt.Sprintf("FAIL: %d lost, %d duplicated, %d out of order", lost, duplicated, orderViolations), false
	}
	if lost == 0 && duplicated == 0 {
		return "PASS: exactly once", true
	}
	return fmt.Sprintf("FAIL: %d lost, %d duplicated", lost, duplicated), false
}

// pool runs the consumer processes of one mode.
type pool struct {
	cfg             Config
	mode            Mode
	groupCommit     bool
	runID           string
	topic           string
	handler         string
	deadLetterTopic string
	brokerURL       string
	dbURL           string

	mu       sync.Mutex
	procs    map[int]*proc
	finished int64 // deliveries reported by consumers that have exited
	lastOut  time.Time
}

// deliveries returns the deliveries all consumers of the mode have reported.
func (p *pool) deliveries() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := p.finished
	for _, pr := range p.procs {
		n += pr.delivered.Load()
	}
	return n
}

type proc struct {
	id        int
	cmd       *exec.Cmd
	crash     *Crash
	done      chan struct{}
	delivered atomic.Int64 // as last reported by the consumer
	poisoned  atomic.Bool  // the crash-loop message is killing it
}

type exitEvent struct {
	id       int
	crash    *Crash
	crashed  bool // its armed crash point fired
	poisoned bool // the crash-loop message killed it
}

func (p *pool) args(id int, crash *Crash) []string {
	args := append([]string(nil), p.cfg.Executable[1:]...)
	args = append(args,
		"--broker", p.brokerURL, "--db", p.dbURL, "--topic", p.topic, "--handler", p.handler,
		"--mode", p.mode.QoS.String(), "--run", p.runID, "--consumer", fmt.Sprint(id),
		"--concurrency", fmt.Sprint(p.cfg.Concurrency), "--dead-letter-topic", p.deadLetterTopic,
		"--max-deliveries", fmt.Sprint(p.cfg.MaxDeliveries))
	if p.groupCommit {
		args = append(args, "--group-commit")
	}
	if p.mode.Batch {
		args = append(args, "--batch")
	}
	if p.mode.Dedup != DedupByID {
		args = append(args, "--dedup", string(p.mode.Dedup))
	}
	if crash != nil {
		args = append(args, "--crash", crash.String())
	}
	return args
}

// restart starts consumer id, counting an armed crash point that fires before the consumer is
// ready as a kill and starting it again unarmed.
//
// A consumer that fails to start (its database or broker connection was just cut, say) is
// tried again, up to 10 times.
func (p *pool) restart(ctx context.Context, id int, crash *Crash, res *Result) error {
	var err error
	// Ten attempts, and one more for each death of the crash-loop message.
	for attempt := 0; attempt < 10+p.cfg.MaxDeliveries; attempt++ {
		err = p.start(ctx, id, crash)
		var early *earlyCrash
		if errors.As(err, &early) {
			res.countCrash(early.crash.Point)
			crash = nil
			continue
		}
		if errors.Is(err, errPoisonedEarly) {
			res.Poison.Kills++
			continue
		}
		if err == nil || ctx.Err() != nil {
			return err
		}
		p.cfg.Logger.Warn("consumer failed to start; trying again", "consumer", id, "error", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	return err
}

// start runs consumer id and waits until it has subscribed.
func (p *pool) start(ctx context.Context, id int, crash *Crash) error {
	cmd := exec.CommandContext(ctx, p.cfg.Executable[0], p.args(id, crash)...)
	logFile, err := os.OpenFile(filepath.Join(p.cfg.Dir, fmt.Sprintf("consumer-%s-%d.log", p.topic, id)),
		os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd.Stderr = logFile
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start consumer: %w", err)
	}
	pr := &proc{id: id, cmd: cmd, crash: crash, done: make(chan struct{})}
	ready := make(chan bool, 1)
	go func() {
		// Everything the consumer wrote is read before Wait, which closes the pipe: the line
		// of a consumer that the crash-loop message kills comes just before its death.
		sc := bufio.NewScanner(stdout)
		ok := sc.Scan() && sc.Text() == "ready"
		if !ok && sc.Text() == poisonKillLine {
			pr.poisoned.Store(true)
		}
		ready <- ok
		for sc.Scan() {
			var n int64
			if sc.Text() == poisonKillLine {
				pr.poisoned.Store(true)
			} else if _, err := fmt.Sscanf(sc.Text(), "delivered %d", &n); err == nil {
				pr.delivered.Store(n)
			}
		}
		_ = cmd.Wait()
		close(pr.done)
	}()
	select {
	case ok := <-ready:
		if !ok {
			<-pr.done
			if pr.poisoned.Load() && killedBySIGKILL(cmd.ProcessState) {
				// The crash-loop message reached it before the ready line was out.
				return errPoisonedEarly
			}
			if crash != nil && killedBySIGKILL(cmd.ProcessState) {
				// The armed crash point fired before the ready line was out.
				return &earlyCrash{crash: *crash}
			}
			return fmt.Errorf("consumer %d exited before subscribing (%s): %s", id, cmd.ProcessState, lastLine(logFile.Name()))
		}
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		return fmt.Errorf("consumer %d did not subscribe within 2 minutes", id)
	}
	p.mu.Lock()
	if p.procs == nil {
		p.procs = map[int]*proc{}
	}
	p.procs[id] = pr
	p.mu.Unlock()
	return nil
}

// errPoisonedEarly reports a consumer that the crash-loop message killed before it said it was
// ready.
var errPoisonedEarly = errors.New("consumer killed by the crash-loop message while starting")

// earlyCrash reports a consumer whose armed crash point fired before it said it was ready.
type earlyCrash struct{ crash Crash }

func (e *earlyCrash) Error() string {
	return "consumer died at " + e.crash.String() + " while starting"
}

func killedBySIGKILL(ps *os.ProcessState) bool {
	ws, ok := ps.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// pick returns a running consumer at random, preferring those without an armed crash point so
// that armed crash points get the chance to fire.
func (p *pool) pick(rng *rand.Rand) (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var unarmed, armed []int
	for id, pr := range p.procs {
		if pr.crash == nil {
			unarmed = append(unarmed, id)
		} else {
			armed = append(armed, id)
		}
	}
	ids := unarmed
	if len(ids) == 0 {
		ids = armed
	}
	if len(ids) == 0 {
		return 0, false
	}
	slices.Sort(ids)
	return ids[rng.IntN(len(ids))], true
}

// kill sends SIGKILL to consumer id and waits for it to die.
func (p *pool) kill(id int) {
	p.mu.Lock()
	pr := p.procs[id]
	delete(p.procs, id)
	if pr != nil {
		p.finished += pr.delivered.Load()
	}
	p.mu.Unlock()
	if pr == nil {
		return
	}
	_ = pr.cmd.Process.Signal(syscall.SIGKILL)
	<-pr.done
}

// reap returns the consumers that exited on their own since the last call.
func (p *pool) reap() []exitEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []exitEvent
	for id, pr := range p.procs {
		select {
		case <-pr.done:
		default:
			continue
		}
		delete(p.procs, id)
		p.finished += pr.delivered.Load()
		ev := exitEvent{id: id, crash: pr.crash}
		switch {
		case pr.poisoned.Load() && killedBySIGKILL(pr.cmd.ProcessState):
			ev.poisoned = true
		case pr.crash != nil && killedBySIGKILL(pr.cmd.ProcessState):
			ev.crashed = true
		default:
			p.cfg.Logger.Warn("consumer exited", "consumer", id, "state", pr.cmd.ProcessState.String())
		}
		out = append(out, ev)
	}
	return out
}

// stopAll stops every consumer gracefully, then forcefully after 10 s.
func (p *pool) stopAll() {
	p.mu.Lock()
	procs := p.procs
	p.procs = nil
	p.mu.Unlock()
	for _, pr := range procs {
		_ = pr.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, pr := range procs {
		select {
		case <-pr.done:
		case <-time.After(10 * time.Second):
			_ = pr.cmd.Process.Kill()
			<-pr.done
		}
	}
}

// reportProgress rewrites one progress line on a terminal, and writes a line every 5 s
// elsewhere.
func (p *pool) reportProgress(cfg Config, mode Mode, distinct int, kills, cuts int) {
	if cfg.Progress == nil {
		return
	}
	f, isFile := cfg.Progress.(*os.File)
	tty := isFile && term.IsTerminal(int(f.Fd()))
	every, prefix, suffix := 5*time.Second, "", "\n"
	if tty {
		every, prefix, suffix = 250*time.Millisecond, "\r", "   "
	}
	if time.Since(p.lastOut) < every {
		return
	}
	p.lastOut = time.Now()
	fmt.Fprintf(cfg.Progress, "%s%-18s %6d/%d messages with an effect, %d kills, %d connection cuts%s",
		prefix, mode.String(), distinct, cfg.Messages, kills, cuts, suffix)
}

// lastLine returns the last line of the file at path, for error messages.
func lastLine(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}
