package onceflowtest

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
)

// This file writes the account of a message that went wrong: what the run saw happen to it,
// and what that shows about the handler.

// fact is one line of an account, at a time since the start of the run (-1: before it).
type fact struct {
	at   time.Duration
	text string
}

// faultsMet are the faults a message met, as its events show them.
type faultsMet struct {
	received, injected, crashedBefore bool
	// applied counts its deliveries that were acknowledged, and those whose process died
	// before the ack after it may have committed (mayHaveCommitted): each applied it at most
	// once.
	applied int
}

// explain returns the account's lines of the message with id, whose problem is problem, and
// the cause they point at.
func (r *runner) explain(id, problem string, effects int) (lines []string, cause string) {
	r.pool.mu.Lock()
	events := slices.Clone(r.pool.events[id])
	r.pool.mu.Unlock()

	var facts []fact
	i, good := r.good[id]
	if good && r.dups[i] {
		facts = append(facts, fact{-1, "published twice with the same id (a deliberate duplicate)"})
	}
	var met faultsMet
	for k, e := range events {
		var text string
		switch {
		case e.what == "acked":
			met.applied++
			continue // on its delivery's line
		case e.what == "received":
			met.received = true
			text = fmt.Sprintf("received by %s", e.proc)
			at, ok := ackOf(events, k)
			if !ok && mayHaveCommitted(events, e.proc) {
				met.applied++
			}
			if ok {
				text += ", acked at " + fmtAt(at)
			} else if end := e.proc.end; end != "" && end != endStopped && !diesOn(events, e.proc) {
				text += ", which " + end + " before acking it"
			}
		case strings.HasPrefix(e.what, "injected "):
			met.injected = true
			text = fmt.Sprintf("%s injected after its processor returned, in %s", strings.TrimPrefix(e.what, "injected "), e.proc)
		case strings.HasPrefix(e.what, "crash "):
			point := CrashPoint(strings.TrimPrefix(e.what, "crash "))
			met.crashedBefore = met.crashedBefore || point == BeforeCommit
			text = fmt.Sprintf("%s died on it, at crash point %s", e.proc, point)
		case e.what == "poison-kill":
			text = fmt.Sprintf("it killed %s (crash loop)", e.proc)
		}
		facts = append(facts, fact{e.at, text})
	}
	if len(events) > 0 {
		first, last := events[0].at, events[len(events)-1].at
		for _, c := range r.cuts {
			if c.at >= first-time.Second && c.at <= last+time.Second {
				facts = append(facts, fact{c.at, "the " + c.service + " connections were cut"})
			}
		}
	} else {
		facts = append(facts, fact{-1, "never received by a consumer"})
	}
	slices.SortStableFunc(facts, func(a, b fact) int { return cmp.Compare(a.at, b.at) })
	for _, f := range facts {
		if f.at < 0 {
			lines = append(lines, f.text)
		} else {
			lines = append(lines, fmtAt(f.at)+" "+f.text)
		}
	}

	switch {
	case strings.Contains(problem, "times"): // applied more than once
		cause = r.duplicateCause(met, effects)
	case strings.HasPrefix(problem, "lost") && r.info.qos == onceflow.BestEffort && met.received:
		cause = "BestEffort acknowledges a message on receipt: a consumer that dies before the commit, or a failure, loses it"
	case strings.HasPrefix(problem, "lost") && !met.received:
		cause = "no consumer received it: does the handler consume the topic the run publishes to?"
	}
	return lines, cause
}

// duplicateCause says why a message was applied effects times, more than once, from the faults
// it met. If the handler's writes are all in its transaction, each acknowledged delivery, and
// each whose process died after it may have committed, applied it at most once, and with
// duplicate detection only one did: more effects than that are writes that outlived a rollback
// or a crash.
func (r *runner) duplicateCause(met faultsMet, effects int) string {
	applied := met.applied
	if r.info.dedup {
		applied = 1
	}
	outlived := effects > applied
	switch {
	// A crash before the commit says more than an injected failure: a stage that commits on
	// its own rolls an injected failure back, and only the crash shows it.
	case outlived && met.crashedBefore:
		return "its consumer died before the handler's transaction committed, yet its effect stayed, and the redelivery applied it again: " +
			"something committed the effect outside the handler's transaction (a write through another connection, or a stage that begins and commits a transaction of its own)"
	case outlived && met.injected:
		return "the run failed its processor after it returned, inside the handler's transaction, which rolled back; " +
			"yet an effect stayed, and the retry applied it again: the processor (or a stage inside the transaction) writes outside the handler's transaction; " +
			"write through processor.TxFromContext"
	case !r.info.dedup && r.info.qos == onceflow.AtLeastOnce:
		return "it was delivered again after its effect committed, and AtLeastOnce detects no duplicates: make the effect idempotent " +
			"(an INSERT that a unique key refuses, with processor.RowsAffectedOrDuplicate), or use ExactlyOnce"
	case !r.info.dedup:
		return fmt.Sprintf("it was delivered again after its effect committed, and the chain detects no duplicates (%s): keep the %s stage, or make the effect idempotent",
			r.info.chain, onceflow.StageDeduplicate)
	}
	return "it was applied again although the chain detects duplicates: its effect and its duplicate-detection record did not commit together " +
		"(a write outside the handler's transaction, or a stage that commits on its own)"
}

// ackOf returns when the delivery of events[k], a receipt, was acked: at the first ack of the
// message by its process after it.
func ackOf(events []event, k int) (time.Duration, bool) {
	for _, e := range events[k+1:] {
		if e.proc == events[k].proc && e.what == "acked" {
			return e.at, true
		}
	}
	return 0, false
}

// mayHaveCommitted reports whether pr, which received a delivery of the message of events and
// did not ack it, may have committed its effect before it died: it was killed at random, or
// died at crash point after-commit, and not at an earlier crash point on this message.
func mayHaveCommitted(events []event, pr *proc) bool {
	if slices.ContainsFunc(events, func(e event) bool {
		return e.proc == pr && (e.what == "crash "+string(BeforeCommit) || e.what == "crash "+string(AfterReceive))
	}) {
		return false
	}
	return strings.HasPrefix(pr.end, endKilled) || pr.crashed && pr.crash != nil && pr.crash.Point == AfterCommit
}

// diesOn reports whether pr's death is one of events already (a crash point or the crash loop
// on the message), so that its delivery line need not say it again.
func diesOn(events []event, pr *proc) bool {
	return slices.ContainsFunc(events, func(e event) bool {
		return e.proc == pr && (strings.HasPrefix(e.what, "crash ") || e.what == "poison-kill")
	})
}
