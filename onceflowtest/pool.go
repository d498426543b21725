package onceflowtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// This file runs the consumer processes of a run: it starts them, kills them, restarts them,
// and keeps what each one reported through its control pipe.

// pool runs the consumer processes of one run.
type pool struct {
	command []string
	dir     string
	base    spec // every consumer's spec, but for Consumer and Crash
	logger  *slog.Logger
	started time.Time

	mu     sync.Mutex
	procs  map[int]*proc // the running process of each consumer
	all    []*proc       // every process, in the order they started
	events map[string][]event
	recv   int // deliveries reported
}

// proc is one consumer process.
type proc struct {
	consumer int
	n        int // its number among the run's processes, from 1
	cmd      *exec.Cmd
	crash    *crash
	done     chan struct{} // closed once it has exited and its control pipe is read
	ready    chan struct{} // closed when it says it subscribed
	// end says how it ended, as a phrase that follows "which then", for the accounts; set by
	// the pool.
	end string
	// crashed: its armed crash point fired; poisoned: the crash-loop message killed it.
	crashed, poisoned bool
}

func (p *proc) String() string { return fmt.Sprintf("consumer %d (process %d)", p.consumer, p.n) }

// endStopped is the end of a process that the run stopped; endKilled begins that of one it
// killed at random.
const (
	endStopped = "was stopped at the end of the run"
	endKilled  = "was killed at random (SIGKILL)"
)

// event is what the run learnt of a message: a delivery to a process, a fault injected into
// it there, or the death of the process on it.
type event struct {
	at   time.Duration // since the start of the run
	proc *proc
	what string
}

// start starts consumer id, armed with c (nil for none), and waits until it has subscribed.
func (p *pool) start(ctx context.Context, id int, c *crash) (*proc, error) {
	s := p.base
	s.Consumer, s.Crash = id, c
	env, err := json.Marshal(s)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	pr := &proc{consumer: id, n: len(p.all) + 1, crash: c, done: make(chan struct{}), ready: make(chan struct{})}
	p.all = append(p.all, pr)
	p.mu.Unlock()

	cmd := exec.Command(p.command[0], p.command[1:]...)
	cmd.Env = append(os.Environ(), envSpec+"="+string(env))
	logFile, err := os.OpenFile(p.logPath(id), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	fmt.Fprintf(logFile, "--- %s, crash point %v\n", pr, c)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// The consumer watches stdin: when this process dies, the pipe closes and the consumer
	// follows.
	if _, err := cmd.StdinPipe(); err != nil {
		return nil, err
	}
	ctlR, ctlW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.ExtraFiles = []*os.File{ctlW}
	if err := cmd.Start(); err != nil {
		ctlR.Close()
		ctlW.Close()
		return nil, fmt.Errorf("start %s: %w", pr, err)
	}
	ctlW.Close()
	pr.cmd = cmd
	go func() {
		ready := false
		lines(ctlR, func(line string) {
			if !ready && line == lineReady {
				ready = true
				close(pr.ready)
				return
			}
			p.note(pr, line)
		})
		ctlR.Close()
		_ = cmd.Wait()
		close(pr.done)
	}()
	select {
	case <-pr.ready:
	case <-pr.done:
		select {
		case <-pr.ready: // ready, then dead at once: reap tells how
			return pr, p.register(pr)
		default:
		}
		switch {
		case pr.poisoned && killed(cmd.ProcessState):
			return pr, errPoisonedEarly
		case c != nil && killed(cmd.ProcessState):
			pr.crashed = true
			return pr, &earlyCrash{crash: *c}
		}
		return pr, fmt.Errorf("%s exited before subscribing (%s): %s", pr, cmd.ProcessState, lastLine(p.logPath(id)))
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		<-pr.done
		return pr, ctx.Err()
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		<-pr.done
		return pr, fmt.Errorf("%s did not subscribe within 2 minutes: %s", pr, lastLine(p.logPath(id)))
	}
	return pr, p.register(pr)
}

// register makes pr the running process of its consumer.
func (p *pool) register(pr *proc) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.procs == nil {
		p.procs = map[int]*proc{}
	}
	p.procs[pr.consumer] = pr
	return nil
}

func (p *pool) logPath(id int) string {
	return filepath.Join(p.dir, fmt.Sprintf("consumer-%s-%d.log", p.base.Run, id))
}

// note records the control line of pr.
func (p *pool) note(pr *proc, line string) {
	ev, kind, id, ok := parseLine(line)
	if !ok {
		return
	}
	at := time.Since(p.started)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.events == nil {
		p.events = map[string][]event{}
	}
	var what string
	switch ev {
	case lineReceived:
		p.recv++
		what = "received"
	case lineAcked:
		what = "acked"
	case lineInjected:
		what = "injected " + kind
	case lineCrash:
		what = "crash " + kind
	case linePoisonKill:
		pr.poisoned = true
		what = "poison-kill"
	default:
		return
	}
	p.events[id] = append(p.events[id], event{at: at, proc: pr, what: what})
}

// errPoisonedEarly reports a consumer that the crash-loop message killed before it said it was
// ready.
var errPoisonedEarly = errors.New("consumer killed by the crash-loop message while starting")

// earlyCrash reports a consumer whose armed crash point fired before it said it was ready.
type earlyCrash struct{ crash crash }

func (e *earlyCrash) Error() string {
	return "consumer died at " + e.crash.String() + " while starting"
}

func killed(ps *os.ProcessState) bool {
	ws, ok := ps.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// deliveries returns the deliveries the consumers reported.
func (p *pool) deliveries() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.recv
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
func (p *pool) kill(id int) (armed *crash) {
	p.mu.Lock()
	pr := p.procs[id]
	delete(p.procs, id)
	if pr != nil {
		pr.end = fmt.Sprintf("%s at %s", endKilled, p.since())
	}
	p.mu.Unlock()
	if pr == nil {
		return nil
	}
	_ = pr.cmd.Process.Kill()
	<-pr.done
	return pr.crash
}

func (p *pool) since() string { return fmtAt(time.Since(p.started)) }

// exited is a consumer that exited on its own.
type exited struct {
	id                int
	crash             *crash
	crashed, poisoned bool
}

// reap returns the consumers that exited on their own since the last call.
func (p *pool) reap() []exited {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []exited
	for id, pr := range p.procs {
		select {
		case <-pr.done:
		default:
			continue
		}
		delete(p.procs, id)
		ev := exited{id: id, crash: pr.crash}
		switch {
		case pr.poisoned && killed(pr.cmd.ProcessState):
			ev.poisoned = true
			pr.end = "was killed by the crash-loop message at " + p.since()
		case pr.crash != nil && killed(pr.cmd.ProcessState):
			ev.crashed, pr.crashed = true, true
			pr.end = fmt.Sprintf("died at crash point %s at %s", pr.crash.Point, p.since())
		default:
			pr.end = fmt.Sprintf("exited (%s) at %s", pr.cmd.ProcessState, p.since())
			p.logger.Warn("consumer exited", "consumer", id, "state", pr.cmd.ProcessState.String(), "log", lastLine(p.logPath(id)))
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
	for _, pr := range procs {
		pr.end = endStopped
	}
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

// restart starts consumer id armed with c, counting an armed crash point that fires before the
// consumer is ready (and starting it again unarmed) and a death by the crash-loop message. A
// consumer that fails to start (its connection was just cut, say) is tried again, up to 10
// times.
func (p *pool) restart(ctx context.Context, id int, c *crash, r *Report) error {
	var err error
	// Deaths at start-up are bounded by the delivery limit of the message that causes them;
	// 50 starts in all are more than any limit a run should have.
	for failures, starts := 0, 0; failures < 10 && starts < 50; starts++ {
		var pr *proc
		pr, err = p.start(ctx, id, c)
		var early *earlyCrash
		switch {
		case errors.As(err, &early):
			r.countCrash(early.crash.Point)
			pr.end = fmt.Sprintf("died at crash point %s while starting, at %s", early.crash.Point, p.since())
			c = nil
			continue
		case errors.Is(err, errPoisonedEarly):
			pr.end = "was killed by the crash-loop message while starting, at " + p.since()
			if r.Poison != nil {
				r.Poison.Kills++
			}
			continue
		case err == nil, ctx.Err() != nil:
			return err
		}
		failures++
		p.logger.Warn("consumer failed to start; trying again", "consumer", id, "error", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	return err
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

// fmtAt formats a time since the start of the run.
func fmtAt(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) }
