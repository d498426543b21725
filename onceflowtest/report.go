package onceflowtest

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Report is what a run measured: the faults it injected, and what became of each message.
type Report struct {
	// Handler and QoS are the handler under test's name and quality of service; Chain its
	// chain, outermost first.
	Handler string `json:"handler"`
	QoS     string `json:"qos"`
	Chain   string `json:"chain"`
	// Broker and Database are where it ran, without passwords.
	Broker   string `json:"broker"`
	Database string `json:"database"`
	// Seed repeats the choice of messages and faults (Config.Seed).
	Seed uint64 `json:"seed"`

	// Messages is the number of distinct good messages published; Duplicates how many of
	// them were published a second time.
	Messages   int `json:"messages"`
	Duplicates int `json:"duplicate_publishes"`
	// Failures and Panics are the messages into whose first attempt a failure or a panic was
	// injected.
	Failures int `json:"injected_failures"`
	Panics   int `json:"injected_panics"`
	// Kills counts the consumer processes killed with SIGKILL: at random, and at the crash
	// points (CrashPoints counts those by point), but not those the crash-loop message killed
	// (PoisonResult.Kills).
	Kills       int                `json:"kills"`
	CrashPoints map[CrashPoint]int `json:"crash_point_kills"`
	// Cuts counts the connection cuts.
	Cuts int `json:"connection_cuts"`
	// Left says which faults the run left out, and why.
	Left []string `json:"left_out,omitempty"`

	// Lost counts the good messages without an effect, Duplicated those with more than one.
	Lost       int `json:"lost"`
	Duplicated int `json:"duplicated"`
	// OutOfOrder counts, for a handler of ExactlyOnceInOrder, the messages applied after a
	// later sequence of their key; nil for the other handlers, which promise no order.
	OutOfOrder *int `json:"order_violations,omitempty"`
	// Poison is what became of the poison messages; nil when none was published.
	Poison *PoisonResult `json:"poison,omitempty"`
	// MsgsPerSec is the rate at which effects were applied, from the first publish to the last
	// new effect, faults included: not a benchmark.
	MsgsPerSec float64 `json:"msgs_per_s"`
	// Accounts tell, for each message that went wrong, what happened to it.
	Accounts []Account `json:"accounts,omitempty"`
	// Logs is the directory of the consumers' logs, when it outlives the run (Config.Dir).
	Logs string `json:"logs,omitempty"`
}

// Account is what happened to one message that went wrong.
type Account struct {
	// ID is the message's id.
	ID string `json:"id"`
	// Problem says what went wrong: "lost", "applied 2 times", "applied out of order", ...
	Problem string `json:"problem"`
	// Events are what the run saw happen to it, in order, each with its time since the start
	// of the run.
	Events []string `json:"events"`
	// Cause says what those events show about the handler, when they show something.
	Cause string `json:"cause,omitempty"`
}

// String formats a in a few lines.
func (a Account) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "message %s: %s", a.ID, a.Problem)
	for _, e := range a.Events {
		b.WriteString("\n    " + e)
	}
	if a.Cause != "" {
		b.WriteString("\n    => " + a.Cause)
	}
	return b.String()
}

// ExactlyOnce reports whether the run found every good message applied exactly once (in order,
// for ExactlyOnceInOrder), and every poison message dead-lettered exactly once with nothing of
// it applied.
func (r Report) ExactlyOnce() bool {
	return r.Lost == 0 && r.Duplicated == 0 && (r.OutOfOrder == nil || *r.OutOfOrder == 0) && r.Poison.Held()
}

// accountsShown is how many accounts an error spells out; the others are listed by id.
const accountsShown = 5

// Err returns nil when the run found the handler exactly-once (ExactlyOnce), and otherwise an
// error that says what went wrong, message by message, and after which fault.
func (r Report) Err() error {
	if r.ExactlyOnce() {
		return nil
	}
	var b strings.Builder
	fmt.Fprintf(&b, "handler %q (%s) is not exactly-once under faults: %s", r.Handler, r.QoS, r.outcome())
	for i, a := range r.Accounts {
		if i == accountsShown {
			var ids []string
			for _, a := range r.Accounts[i:min(len(r.Accounts), i+20)] {
				ids = append(ids, a.ID)
			}
			more := ""
			if len(r.Accounts) > i+20 {
				more = ", ..."
			}
			fmt.Fprintf(&b, "\n  and %d more: %s%s", len(r.Accounts)-i, strings.Join(ids, ", "), more)
			break
		}
		b.WriteString("\n  " + strings.ReplaceAll(a.String(), "\n", "\n  "))
	}
	fmt.Fprintf(&b, "\n  %s", r.Faults())
	return errors.New(b.String())
}

// outcome says what the run found, in a phrase.
func (r Report) outcome() string {
	var parts []string
	if r.Duplicated > 0 {
		parts = append(parts, fmt.Sprintf("%d of %d messages applied more than once", r.Duplicated, r.Messages))
	}
	if r.Lost > 0 {
		parts = append(parts, fmt.Sprintf("%d of %d lost", r.Lost, r.Messages))
	}
	if r.OutOfOrder != nil && *r.OutOfOrder > 0 {
		parts = append(parts, fmt.Sprintf("%d applied out of order", *r.OutOfOrder))
	}
	if r.Poison != nil {
		parts = append(parts, r.Poison.String())
	}
	if r.Lost == 0 && r.Duplicated == 0 && (r.OutOfOrder == nil || *r.OutOfOrder == 0) {
		exactly := fmt.Sprintf("each of %d messages applied exactly once", r.Messages)
		if r.OutOfOrder != nil {
			exactly += ", in order"
		}
		parts = append([]string{exactly}, parts...)
	}
	return strings.Join(parts, "; ")
}

// Faults describes the faults of the run in a line.
func (r Report) Faults() string {
	points := slices.Sorted(maps.Keys(r.CrashPoints))
	var at []string
	for _, p := range points {
		at = append(at, fmt.Sprintf("%s %d", p, r.CrashPoints[p]))
	}
	crashes := "none at a crash point"
	if len(at) > 0 {
		crashes = strings.Join(at, ", ")
	}
	s := fmt.Sprintf("faults: %d messages, %d published twice, %d kills (%s), %d connection cuts, %d injected failures, %d injected panics; seed %d",
		r.Messages, r.Duplicates, r.Kills, crashes, r.Cuts, r.Failures, r.Panics, r.Seed)
	if r.Logs != "" {
		s += "; consumer logs in " + r.Logs
	}
	return s
}

// String summarises r in a line.
func (r Report) String() string {
	return fmt.Sprintf("handler %q (%s) on %s and %s: %s; %s", r.Handler, r.QoS, r.Broker, r.Database, r.outcome(), r.Faults())
}

func (r *Report) countCrash(p CrashPoint) {
	r.Kills++
	r.CrashPoints[p]++
}
