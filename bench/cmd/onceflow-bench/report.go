package main

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// medians returns one entry per cell: the successful round with the median rate (the lower
// middle one for an even count), or in the steady state with the median p99 latency.
func medians(entries []Entry) []Entry {
	byName := map[string][]Entry{}
	var order []string
	for _, e := range entries {
		if _, seen := byName[e.Name]; !seen {
			order = append(order, e.Name)
			byName[e.Name] = []Entry{}
		}
		if e.Error == "" {
			byName[e.Name] = append(byName[e.Name], e)
		}
	}
	var out []Entry
	for _, name := range order {
		es := byName[name]
		if len(es) == 0 {
			continue
		}
		key := func(e Entry) float64 {
			if e.Scenario == scenarioSteady {
				return e.LatencyP99Ms
			}
			return e.MsgsPerS
		}
		slices.SortStableFunc(es, func(a, b Entry) int { return cmp.Compare(key(a), key(b)) })
		m := es[(len(es)-1)/2]
		m.Round = 0
		out = append(out, m)
	}
	return out
}

// find returns the median entry named name.
func find(ms []Entry, name string) (Entry, bool) {
	i := slices.IndexFunc(ms, func(e Entry) bool { return e.Name == name })
	if i < 0 {
		return Entry{}, false
	}
	return ms[i], true
}

// drainName names the drain cell of variant v of st at concurrency c, at the run's prefetch.
func drainName(st setup, v string, c int) string {
	return cell{st: st, variant: v, c: c, scenario: scenarioDrain}.name()
}

func rateOf(ms []Entry, st setup, v string, c int) float64 {
	e, _ := find(ms, drainName(st, v, c))
	return e.MsgsPerS
}

// dbLimitSetup is the setup whose cells measured the database limit of st: the first of the
// run with st's database.
func dbLimitSetup(setups []setup, st setup) setup {
	for _, o := range setups {
		if o.Database == st.Database {
			return o
		}
	}
	return st
}

// Target is one of the targets, evaluated on the medians of one setup at one
// concurrency.
type Target struct {
	Setup       string  `json:"setup"`
	Concurrency int     `json:"concurrency"`
	Target      string  `json:"target"`
	Ratio       float64 `json:"ratio"` // the ratio, or the latency in ms
	Want        float64 `json:"want"`
	AtMost      bool    `json:"at_most,omitempty"` // Ratio must not exceed Want
	Met         bool    `json:"met"`
	// Binding says, for a missed target, which resource binds, with the expert beside it.
	Binding string `json:"binding,omitempty"`
}

// ratioTargets are the targets on the drain: a ratio of two variants' median rates,
// and its least value.
var ratioTargets = []struct {
	name     string
	num, den string
	want     float64
	only     int // the concurrency it applies to; 0 for every one
}{
	{"batch+GC >= 1.0x expert", vBatch, vExpert, 1.0, 0},
	{"EO+GC >= 0.5x expert", vGroupCommit, vExpert, 0.5, 0},
	{"EO+GC >= 4x watermill", vGroupCommit, vBaseline, 4, 16},
	{"ExactlyOnce >= 1.0x watermill", vExactlyOnce, vBaseline, 1.0, 0},
}

// The steady-state targets: group commit's p99 latency, absolute and against per-message
// transactions.
const (
	steadyP99Target      = "steady p99 with EO+GC <= 20 ms"
	steadyP99RatioTarget = "steady p99 EO+GC <= 1.2x ExactlyOnce"
)

func evaluateTargets(cfg suiteConfig, ms []Entry) []Target {
	var out []Target
	for _, st := range cfg.setups {
		for _, d := range ratioTargets {
			for _, c := range cfg.concurrency {
				if d.only != 0 && c != d.only {
					continue
				}
				num, okNum := find(ms, drainName(st, d.num, c))
				den, okDen := find(ms, drainName(st, d.den, c))
				if !okNum || !okDen || num.MsgsPerS == 0 || den.MsgsPerS == 0 {
					continue
				}
				r := num.MsgsPerS / den.MsgsPerS
				t := Target{Setup: st.Name, Concurrency: c, Target: d.name, Ratio: round2(r), Want: d.want, Met: r >= d.want}
				if !t.Met {
					expert, _ := find(ms, drainName(st, vExpert, c))
					t.Binding = binding(st, num, expert)
				}
				out = append(out, t)
			}
		}
		for _, c := range cfg.steadyConc {
			gc, okGC := find(ms, cell{st: st, variant: vGroupCommit, c: c, scenario: scenarioSteady}.name())
			eo, okEO := find(ms, cell{st: st, variant: vExactlyOnce, c: c, scenario: scenarioSteady}.name())
			expert, _ := find(ms, cell{st: st, variant: vExpert, c: c, scenario: scenarioSteady}.name())
			if !okGC || gc.LatencyP99Ms == 0 {
				continue
			}
			beside := fmt.Sprintf("EO+GC p50 %.1f ms, p99 %.1f ms", gc.LatencyP50Ms, gc.LatencyP99Ms)
			if okEO {
				beside += fmt.Sprintf("; ExactlyOnce p99 %.1f ms", eo.LatencyP99Ms)
			}
			if expert.LatencyP99Ms > 0 {
				beside += fmt.Sprintf("; expert p99 %.1f ms", expert.LatencyP99Ms)
			}
			t := Target{Setup: st.Name, Concurrency: c, Target: steadyP99Target, Ratio: gc.LatencyP99Ms, Want: 20, AtMost: true, Met: gc.LatencyP99Ms <= 20}
			if !t.Met {
				t.Binding = beside
			}
			out = append(out, t)
			if okEO && eo.LatencyP99Ms > 0 {
				r := gc.LatencyP99Ms / eo.LatencyP99Ms
				t := Target{Setup: st.Name, Concurrency: c, Target: steadyP99RatioTarget, Ratio: round2(r), Want: 1.2, AtMost: true, Met: r <= 1.2}
				if !t.Met {
					t.Binding = beside
				}
				out = append(out, t)
			}
		}
	}
	return out
}

// binding says what limits e, a drain cell, beside the expert's cell at the same setup and
// concurrency: the CPU when the machine was busy (and which process spends more per message
// than beside the expert), the commits when PostgreSQL synced its WAL far more often per
// message, on SQLite its one writer, and otherwise waiting (round trips in sequence, too few
// deliveries in flight), since cores were left idle.
func binding(st setup, e, expert Entry) string {
	cores := float64(max(numCPU, 1))
	busy := e.CPU["machine"]
	perMsg := func(groups ...string) string {
		var parts []string
		for _, g := range groups {
			if g == "" || slices.ContainsFunc(parts, func(p string) bool { return strings.HasPrefix(p, g+" ") }) {
				continue
			}
			part := fmt.Sprintf("%s %.0f", g, e.CPUPerMsg[g])
			if expert.MsgsPerS > 0 {
				part += fmt.Sprintf(" (expert %.0f)", expert.CPUPerMsg[g])
			}
			parts = append(parts, part)
		}
		return "µs of CPU per message: " + strings.Join(parts, ", ")
	}
	groups := []string{"consumer", brokerGroup(st.Broker), databaseGroup(st.Database)}
	cpu := perMsg(groups...)
	besideExpert := ""
	if expert.MsgsPerS > 0 {
		besideExpert = fmt.Sprintf(" (expert %.2f at %.0f msgs/s)", expert.CPU["machine"], expert.MsgsPerS)
	}
	own := 0.0
	for _, g := range slices.Compact(slices.Sorted(slices.Values(groups))) {
		if g != "" {
			own += e.CPU[g]
		}
	}
	switch {
	case busy >= 0.85*cores:
		// On a shared machine the cores may be busy with others' work: say how much.
		return fmt.Sprintf("CPU: %.2f of %.0f cores busy%s, %.2f of them by the consumer, broker and database, %.2f by other processes; %s",
			busy, cores, besideExpert, own, max(busy-own, 0), cpu)
	case st.Database != "sqlite" && e.WALSyncsPerMsg >= 0.1 && e.WALSyncsPerMsg > 2*expert.WALSyncsPerMsg:
		return fmt.Sprintf("commits: %.3f WAL syncs per message (expert %.3f), %.2f of %.0f cores busy; %s",
			e.WALSyncsPerMsg, expert.WALSyncsPerMsg, busy, cores, cpu)
	case st.Database == "sqlite":
		// Cores left idle do not mean waiting on SQLite: its write transactions run one at a
		// time, each holding the file's write lock for its statements and its commit.
		return fmt.Sprintf("one writer: SQLite runs the write transactions of the application file one at a time, so the CPU each spends in its statements and commit bounds the rate, with %.2f of %.0f cores busy%s and %.3f commits per message (expert %.3f); %s",
			busy, cores, besideExpert, e.WALSyncsPerMsg, expert.WALSyncsPerMsg, cpu)
	}
	return fmt.Sprintf("waiting, not CPU: %.2f of %.0f cores busy%s, so the consumer waits (round trips in sequence, or too few deliveries in flight); %s",
		busy, cores, besideExpert, cpu)
}

var columnTitles = map[string]string{
	vAtLeastOnce: "AtLeastOnce",
	vExactlyOnce: "ExactlyOnce",
	vGroupCommit: "EO+GC",
	vBatch:       "batch+GC",
	vExpert:      "expert",
	vBaseline:    "watermill",
	vDBLimit:     "db-limit",
	vDBLimitGo:   "db-limit-go",
}

// printReport prints, per setup, the median msgs/s of every variant of the drain with the
// issue's ratios, where the CPU goes, the prefetch sweep, the steady state and the slow
// processor; then the targets, with what binds where one is missed.
func printReport(w io.Writer, cfg suiteConfig, res Results) {
	fmt.Fprintf(w, "\nonceflow end-to-end benchmark, %s, %d cores (%s), load average %.2f -> %.2f\n",
		res.Date, res.Machine.Cores, res.Machine.CPU, res.Machine.LoadBefore, res.Machine.LoadAfter)
	fmt.Fprintf(w, "prefetch per subscription for onceflow and watermill %d (broker.Options.Prefetch); expert: prefetch %d, batches of up to %d or %s\n",
		cfg.prefetch, expertPrefetch, expertBatch, expertWait)
	ms := res.Medians
	for _, st := range cfg.setups {
		printDrain(w, cfg, st, ms)
		printSweep(w, cfg, st, ms)
		printSteady(w, cfg, st, ms)
		printSlow(w, cfg, st, ms)
	}
	if len(res.Targets) > 0 {
		fmt.Fprintf(w, "\ntargets (ratios of medians measured side by side in this run):\n")
		for _, t := range res.Targets {
			mark, op := "met", ">="
			if t.AtMost {
				op = "<="
			}
			if !t.Met {
				mark = "NOT MET"
			}
			fmt.Fprintf(w, "  %-8s c=%-3d %-40s %7.2f (want %s %.2f)  %s\n", t.Setup, t.Concurrency, t.Target, t.Ratio, op, t.Want, mark)
			if t.Binding != "" {
				fmt.Fprintf(w, "      binds: %s\n", t.Binding)
			}
		}
	}
	var failed []string
	for _, e := range res.Entries {
		if e.Error != "" {
			failed = append(failed, fmt.Sprintf("  round %d %s: %s", e.Round, e.Name, e.Error))
		}
	}
	if len(failed) > 0 {
		fmt.Fprintf(w, "\nfailed cells:\n%s\n", strings.Join(failed, "\n"))
	}
}

func printDrain(w io.Writer, cfg suiteConfig, st setup, ms []Entry) {
	limits := dbLimitSetup(cfg.setups, st)
	var vs []string
	for _, v := range allVariants {
		src := st
		if v == vDBLimit || v == vDBLimitGo {
			src = limits
		}
		if slices.ContainsFunc(cfg.concurrency, func(c int) bool { return rateOf(ms, src, v, c) > 0 }) {
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return
	}
	tool := "go-loop"
	if st.Database == "postgres" {
		tool = "pgbench"
	}
	fmt.Fprintf(w, "\n%s: backlog drain, msgs/s, median of %d rounds (db-limit: %s", st.Title, cfg.rounds, tool)
	if limits != st {
		fmt.Fprintf(w, ", measured with %s", limits.Name)
	}
	fmt.Fprintln(w, ")")
	fmt.Fprintf(w, "%6s", "conc")
	for _, v := range vs {
		fmt.Fprintf(w, " %11s", columnTitles[v])
	}
	ratios := [][2]string{{vBatch, vExpert}, {vGroupCommit, vExpert}, {vGroupCommit, vBaseline}, {vExactlyOnce, vBaseline}}
	fmt.Fprintf(w, " | %9s %8s %8s %8s\n", "batch/exp", "GC/exp", "GC/wm", "EO/wm")
	for _, c := range cfg.concurrency {
		fmt.Fprintf(w, "%6d", c)
		for _, v := range vs {
			src := st
			if v == vDBLimit || v == vDBLimitGo {
				src = limits
			}
			if r := rateOf(ms, src, v, c); r > 0 {
				fmt.Fprintf(w, " %11.0f", r)
			} else {
				fmt.Fprintf(w, " %11s", "-")
			}
		}
		fmt.Fprint(w, " |")
		for i, p := range ratios {
			width := 8
			if i == 0 {
				width = 9
			}
			num, den := rateOf(ms, st, p[0], c), rateOf(ms, st, p[1], c)
			if num > 0 && den > 0 {
				fmt.Fprintf(w, " %*.2f", width, num/den)
			} else {
				fmt.Fprintf(w, " %*s", width, "-")
			}
		}
		fmt.Fprintln(w)
	}
	c := slices.Max(cfg.concurrency)
	var rows []Entry
	for _, v := range vs {
		if e, ok := find(ms, drainName(st, v, c)); ok && v != vDBLimit && v != vDBLimitGo {
			rows = append(rows, e)
		}
	}
	if len(rows) > 0 {
		fmt.Fprintf(w, "  at c=%d, per message:\n", c)
		printResources(w, st, rows, func(e Entry) string { return columnTitles[e.Mode] })
	}
}

// printResources prints where the CPU of each entry went: cores busy, µs of CPU per message
// of the consumer, the broker and the database (when they run in processes of their own), WAL
// syncs per message, peak RSS.
func printResources(w io.Writer, st setup, rows []Entry, label func(Entry) string) {
	var groups []string
	for _, g := range []string{brokerGroup(st.Broker), databaseGroup(st.Database)} {
		if g != "" {
			groups = append(groups, g)
		}
	}
	fmt.Fprintf(w, "  %-14s %9s %6s %12s", "", "msgs/s", "cores", "consumer µs")
	for _, g := range groups {
		fmt.Fprintf(w, " %12s", g+" µs")
	}
	fmt.Fprintf(w, " %9s %8s\n", "WAL sync", "RSS MiB")
	for _, e := range rows {
		fmt.Fprintf(w, "  %-14s %9.0f %6.2f %12.0f", label(e), e.MsgsPerS, e.CPU["machine"], e.CPUPerMsg["consumer"])
		for _, g := range groups {
			fmt.Fprintf(w, " %12.0f", e.CPUPerMsg[g])
		}
		wal := "-"
		if e.WALSyncsPerMsg > 0 {
			wal = fmt.Sprintf("%.3f", e.WALSyncsPerMsg)
		}
		fmt.Fprintf(w, " %9s %8.1f\n", wal, e.PeakRSSMiB)
	}
}

// printSweep prints group commit's rate by prefetch, and which prefetch wins: the highest
// geometric mean, over the concurrencies, of its rate over the best rate at that concurrency.
func printSweep(w io.Writer, cfg suiteConfig, st setup, ms []Entry) {
	ps := slices.Sorted(slices.Values(append(slices.Clone(cfg.sweep), cfg.prefetch)))
	ps = slices.Compact(ps)
	rate := func(p, c int) float64 {
		e, _ := find(ms, cell{st: st, variant: vGroupCommit, c: c, scenario: scenarioDrain, prefetch: p, sweep: p != cfg.prefetch}.name())
		return e.MsgsPerS
	}
	var concs []int
	for _, c := range cfg.concurrency {
		if slices.ContainsFunc(ps, func(p int) bool { return p != cfg.prefetch && rate(p, c) > 0 }) {
			concs = append(concs, c)
		}
	}
	if len(concs) == 0 {
		return
	}
	fmt.Fprintf(w, "  EO+GC by prefetch per subscription (broker.Options.Prefetch on %s), msgs/s:\n  %6s", st.Broker, "conc")
	for _, p := range ps {
		fmt.Fprintf(w, " %8s", fmt.Sprintf("p%d", p))
	}
	fmt.Fprintln(w, "     best")
	score := map[int]float64{}
	counted := map[int]int{}
	for _, c := range concs {
		fmt.Fprintf(w, "  %6d", c)
		best, bestP := 0.0, 0
		for _, p := range ps {
			r := rate(p, c)
			if r > best {
				best, bestP = r, p
			}
			if r > 0 {
				fmt.Fprintf(w, " %8.0f", r)
			} else {
				fmt.Fprintf(w, " %8s", "-")
			}
		}
		fmt.Fprintf(w, " %8s\n", fmt.Sprintf("p%d", bestP))
		for _, p := range ps {
			if r := rate(p, c); r > 0 && best > 0 {
				score[p] += math.Log(r / best)
				counted[p]++
			}
		}
	}
	winner, parts := 0, []string{}
	for _, p := range ps {
		if counted[p] == 0 {
			continue
		}
		g := math.Exp(score[p] / float64(counted[p]))
		parts = append(parts, fmt.Sprintf("p%d %.2f", p, g))
		if winner == 0 || g > math.Exp(score[winner]/float64(counted[winner])) {
			winner = p
		}
	}
	fmt.Fprintf(w, "  prefetch %d wins for group commit on %s (geometric mean of rate / best: %s)\n", winner, st.Broker, strings.Join(parts, ", "))
}

func printSteady(w io.Writer, cfg suiteConfig, st setup, ms []Entry) {
	for _, c := range cfg.steadyConc {
		var rows []Entry
		for _, v := range cfg.steadyVariants {
			if e, ok := find(ms, cell{st: st, variant: v, c: c, scenario: scenarioSteady}.name()); ok {
				rows = append(rows, e)
			}
		}
		if len(rows) == 0 {
			continue
		}
		fmt.Fprintf(w, "  steady state at c=%d, %.0f msgs/s offered for %g s after %g s: latency from publish to commit (ms)\n",
			c, cfg.rate, cfg.steadySeconds, cfg.steadyWarmup)
		fmt.Fprintf(w, "  %-14s %9s %8s %8s %8s %6s %10s\n", "", "commits/s", "p50", "p99", "max", "cores", "consumer")
		for _, e := range rows {
			fmt.Fprintf(w, "  %-14s %9.0f %8.1f %8.1f %8.1f %6.2f %10.0f\n", columnTitles[e.Mode], e.MsgsPerS,
				e.LatencyP50Ms, e.LatencyP99Ms, e.LatencyMaxMs, e.CPU["machine"], e.CPUPerMsg["consumer"])
		}
	}
}

func printSlow(w io.Writer, cfg suiteConfig, st setup, ms []Entry) {
	var rows []Entry
	for _, v := range cfg.slowVariants {
		if e, ok := find(ms, cell{st: st, variant: v, c: cfg.slowConc, scenario: scenarioSlow}.name()); ok {
			rows = append(rows, e)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "  slow processor (waits %s per call: per message, per batch for batch+GC), backlog drain at c=%d:\n", cfg.slowWait, cfg.slowConc)
	printResources(w, st, rows, func(e Entry) string { return columnTitles[e.Mode] })
}
