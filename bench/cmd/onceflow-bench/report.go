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

// drainEntry returns the median entry of variant v of st at concurrency c in a drain scenario
// (drain or small), at the run's prefetch.
func drainEntry(ms []Entry, st setup, scenario, v string, c int) (Entry, bool) {
	return find(ms, cell{st: st, variant: v, c: c, scenario: scenario}.name())
}

// rateOf returns the median msgs/s of variant v of st at concurrency c in the drain; 0 if it
// did not run.
func rateOf(ms []Entry, st setup, v string, c int) float64 {
	e, _ := drainEntry(ms, st, scenarioDrain, v, c)
	return e.MsgsPerS
}

// steadyEntry returns the median entry of variant v of st at concurrency c and rate in the
// steady state.
func steadyEntry(ms []Entry, st setup, v string, c int, rate float64) (Entry, bool) {
	return find(ms, cell{st: st, variant: v, c: c, scenario: scenarioSteady, rate: rate}.name())
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

// Target is one of the targets, evaluated on the medians of one setup at one concurrency.
type Target struct {
	Setup       string  `json:"setup"`
	Concurrency int     `json:"concurrency"`
	Target      string  `json:"target"`
	Scenario    string  `json:"scenario,omitempty"`
	Payload     int     `json:"payload_bytes,omitempty"` // of a drain
	Rate        float64 `json:"rate,omitempty"`          // offered in the steady state
	Ratio       float64 `json:"ratio"`                   // the ratio, or the latency in ms
	Want        float64 `json:"want"`
	AtMost      bool    `json:"at_most,omitempty"` // Ratio must not exceed Want
	Met         bool    `json:"met"`
	// Binding says, for a missed target, which resource binds, with the expert beside it.
	Binding string `json:"binding,omitempty"`
}

// where says in which cells a target was evaluated.
func (t Target) where() string {
	if t.Scenario == scenarioSteady {
		return fmt.Sprintf("%g/s", t.Rate)
	}
	return fmt.Sprintf("%d B", t.Payload)
}

// ratioTarget is a target on the drains: a ratio of two variants' medians, the rate's (at least
// want) or the consumer's CPU per message (at most want).
type ratioTarget struct {
	name     string
	scenario string // scenarioDrain or scenarioSmall
	num, den string
	want     float64
	cpu      bool
	setups   []string // the setups it applies to; nil for every one
	only     int      // the concurrency it applies to; 0 for every one
}

// ratioTargets are the drains' targets. The default handler, with nothing set but Concurrency,
// must do half what the expert does where the defaults are decided; with small payloads, where
// the consumer's own cost shows most, the batch processor must match the expert in rate at
// every concurrency and in CPU per message where the cores are busy; the older targets stand.
var ratioTargets = []ratioTarget{
	{name: "default >= 0.5x expert", scenario: scenarioDrain, num: vDefault, den: vExpert, want: 0.5, setups: []string{"postgres", "nats"}, only: 16},
	{name: "batch+GC >= 1.0x expert", scenario: scenarioSmall, num: vBatch, den: vExpert, want: 1.0},
	{name: "batch+GC consumer CPU/msg <= 1.1x expert", scenario: scenarioSmall, num: vBatch, den: vExpert, want: 1.1, cpu: true, setups: []string{"postgres", "nats", "redis"}, only: 16},
	{name: "batch+GC >= 1.0x expert", scenario: scenarioDrain, num: vBatch, den: vExpert, want: 1.0},
	{name: "EO+GC >= 0.5x expert", scenario: scenarioDrain, num: vGroupCommit, den: vExpert, want: 0.5},
	{name: "EO+GC >= 4x watermill", scenario: scenarioDrain, num: vGroupCommit, den: vBaseline, want: 4, only: 16},
	{name: "ExactlyOnce >= 1.0x watermill", scenario: scenarioDrain, num: vExactlyOnce, den: vBaseline, want: 1.0},
}

// The steady-state targets: the p99 latency from publish to commit of the default handler and
// of group commit, and group commit's against a transaction per message.
const (
	steadyP99Want        = 20 // ms
	steadyP99RatioTarget = "steady p99 EO+GC <= 1.2x ExactlyOnce"
)

// steadyP99Target names the target of variant v's p99 latency in the steady state.
func steadyP99Target(v string) string {
	return fmt.Sprintf("steady p99 %s <= %d ms", columnTitles[v], steadyP99Want)
}

// evaluateTargets evaluates every target on the medians, target by target, setup by setup.
func evaluateTargets(cfg suiteConfig, ms []Entry) []Target {
	var out []Target
	for _, d := range ratioTargets {
		payload := cfg.payloadSize
		if d.scenario == scenarioSmall {
			payload = cfg.smallPayload
		}
		for _, st := range cfg.setups {
			if d.setups != nil && !slices.Contains(d.setups, st.Name) {
				continue
			}
			for _, c := range cfg.concurrency {
				if d.only != 0 && c != d.only {
					continue
				}
				num, okNum := drainEntry(ms, st, d.scenario, d.num, c)
				den, okDen := drainEntry(ms, st, d.scenario, d.den, c)
				if !okNum || !okDen {
					continue
				}
				a, b := num.MsgsPerS, den.MsgsPerS
				if d.cpu {
					a, b = num.CPUPerMsg["consumer"], den.CPUPerMsg["consumer"]
				}
				if a == 0 || b == 0 {
					continue
				}
				r := a / b
				t := Target{Setup: st.Name, Concurrency: c, Target: d.name, Scenario: d.scenario, Payload: payload,
					Ratio: round2(r), Want: d.want, AtMost: d.cpu, Met: r >= d.want}
				if d.cpu {
					t.Met = r <= d.want
				}
				if !t.Met {
					expert, _ := drainEntry(ms, st, d.scenario, vExpert, c)
					t.Binding = binding(st, num, expert)
				}
				out = append(out, t)
			}
		}
	}
	steady := func(name string, each func(st setup, c int, rate float64) (Target, bool)) {
		for _, st := range cfg.setups {
			for _, rate := range cfg.rates {
				for _, c := range cfg.steadyConc {
					if t, ok := each(st, c, rate); ok {
						t.Setup, t.Concurrency, t.Target, t.Scenario, t.Rate = st.Name, c, name, scenarioSteady, rate
						out = append(out, t)
					}
				}
			}
		}
	}
	// beside lists the steady state's latencies of every variant of the cell's group.
	beside := func(st setup, c int, rate float64) string {
		var parts []string
		for _, v := range cfg.steadyVariants {
			if e, ok := steadyEntry(ms, st, v, c, rate); ok && e.LatencyP99Ms > 0 {
				parts = append(parts, fmt.Sprintf("%s p50 %.1f ms, p99 %.1f ms", columnTitles[v], e.LatencyP50Ms, e.LatencyP99Ms))
			}
		}
		return strings.Join(parts, "; ")
	}
	for _, v := range []string{vDefault, vGroupCommit} {
		steady(steadyP99Target(v), func(st setup, c int, rate float64) (Target, bool) {
			e, ok := steadyEntry(ms, st, v, c, rate)
			if !ok || e.LatencyP99Ms == 0 {
				return Target{}, false
			}
			t := Target{Ratio: e.LatencyP99Ms, Want: steadyP99Want, AtMost: true, Met: e.LatencyP99Ms <= steadyP99Want}
			if !t.Met {
				t.Binding = beside(st, c, rate)
			}
			return t, true
		})
	}
	steady(steadyP99RatioTarget, func(st setup, c int, rate float64) (Target, bool) {
		gc, okGC := steadyEntry(ms, st, vGroupCommit, c, rate)
		eo, okEO := steadyEntry(ms, st, vExactlyOnce, c, rate)
		if !okGC || !okEO || gc.LatencyP99Ms == 0 || eo.LatencyP99Ms == 0 {
			return Target{}, false
		}
		r := gc.LatencyP99Ms / eo.LatencyP99Ms
		t := Target{Ratio: round2(r), Want: 1.2, AtMost: true, Met: r <= 1.2}
		if !t.Met {
			t.Binding = beside(st, c, rate)
		}
		return t, true
	})
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
	vDefault:     "default",
	vAtLeastOnce: "AtLeastOnce",
	vExactlyOnce: "ExactlyOnce",
	vGroupCommit: "EO+GC",
	vBatch:       "batch+GC",
	vExpert:      "expert",
	vBaseline:    "watermill",
	vDBLimit:     "db-limit",
	vDBLimitGo:   "db-limit-go",
}

// printReport prints, per setup, the median msgs/s of every variant of the drains with the
// consumer's and the database's CPU per message beside each, the ratios the targets need,
// where the CPU goes, the prefetch sweep, the steady state, the slow processor and the reruns;
// then the targets, with what binds where one is missed.
func printReport(w io.Writer, cfg suiteConfig, res Results) {
	fmt.Fprintf(w, "\nonceflow end-to-end benchmark, %s, %d cores (%s), load average %.2f -> %.2f\n",
		res.Date, res.Machine.Cores, res.Machine.CPU, res.Machine.LoadBefore, res.Machine.LoadAfter)
	fmt.Fprintf(w, "default: ExactlyOnce with nothing set but Concurrency (the library's defaults: group commit, the prefetch that follows from the handler);\n"+
		"ExactlyOnce, EO+GC (group commit), batch+GC (batch processor): prefetch %d per subscription (broker.Options.Prefetch), as the watermill baseline;\n"+
		"expert: prefetch %d per worker, batches of up to %d or %s, two round trips per transaction on PostgreSQL and MariaDB\n",
		cfg.prefetch, expertPrefetch, expertBatch, expertWait)
	ms := res.Medians
	for _, st := range cfg.setups {
		printDrain(w, cfg, st, ms, scenarioDrain, cfg.payloadSize)
		printDrain(w, cfg, st, ms, scenarioSmall, cfg.smallPayload)
		printSweep(w, cfg, st, ms)
		printSteady(w, cfg, st, ms)
		printSlow(w, cfg, st, ms)
		printReruns(w, cfg, st, ms)
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
			fmt.Fprintf(w, "  %-40s %-8s c=%-3d %-7s %7.2f (want %s %.2f)  %s\n", t.Target, t.Setup, t.Concurrency, t.where(), t.Ratio, op, t.Want, mark)
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

// formatPerMsg formats the consumer's and the database's µs of CPU per message of e,
// "consumer/database": the consumer alone where the database runs in it (SQLite), "-" for the
// consumer of pgbench, which is not the bench process.
func formatPerMsg(st setup, e Entry) string {
	consumer := fmt.Sprintf("%.0f", e.CPUPerMsg["consumer"])
	if e.Tool == "pgbench" {
		consumer = "-"
	}
	db := databaseGroup(st.Database)
	if db == "" {
		return consumer
	}
	return fmt.Sprintf("%s/%.0f", consumer, e.CPUPerMsg[db])
}

// drainRatios are the ratios of a drain's table: onceflow's variants to the expert, and to the
// watermill baseline.
var drainRatios = [][2]string{
	{vDefault, vExpert}, {vGroupCommit, vExpert}, {vBatch, vExpert}, {vGroupCommit, vBaseline}, {vExactlyOnce, vBaseline},
}

// printDrain prints a drain scenario (drain or small) of st: per variant and concurrency the
// median msgs/s and the CPU per message beside it; then the ratios, of the rate and of the
// consumer's CPU per message; for the drain, where the CPU went at the highest concurrency.
func printDrain(w io.Writer, cfg suiteConfig, st setup, ms []Entry, scenario string, payload int) {
	limits := dbLimitSetup(cfg.setups, st)
	entry := func(v string, c int) (Entry, bool) {
		if v == vDBLimit || v == vDBLimitGo {
			if scenario != scenarioDrain {
				return Entry{}, false
			}
			return drainEntry(ms, limits, scenario, v, c)
		}
		return drainEntry(ms, st, scenario, v, c)
	}
	var vs []string
	for _, v := range allVariants {
		if slices.ContainsFunc(cfg.concurrency, func(c int) bool { e, ok := entry(v, c); return ok && e.MsgsPerS > 0 }) {
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return
	}
	db := databaseGroup(st.Database)
	perMsg := "consumer/" + db
	if db == "" {
		perMsg = "consumer, the database in it"
	}
	fmt.Fprintf(w, "\n%s: backlog drain, %d B payloads, median of %d rounds: msgs/s and µs of CPU per message (%s)", st.Title, payload, cfg.rounds, perMsg)
	if slices.Contains(vs, vDBLimit) {
		tool := "go-loop"
		if st.Database == "postgres" {
			tool = "pgbench"
		}
		fmt.Fprintf(w, "; db-limit: %s", tool)
		if limits != st {
			fmt.Fprintf(w, ", measured with %s", limits.Name)
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "  %-12s", "")
	for _, c := range cfg.concurrency {
		fmt.Fprintf(w, " %19s", fmt.Sprintf("c=%d", c))
	}
	fmt.Fprintln(w)
	for _, v := range vs {
		fmt.Fprintf(w, "  %-12s", columnTitles[v])
		for _, c := range cfg.concurrency {
			if e, ok := entry(v, c); ok && e.MsgsPerS > 0 {
				fmt.Fprintf(w, " %8.0f %-10s", e.MsgsPerS, formatPerMsg(st, e))
			} else {
				fmt.Fprintf(w, " %8s %-10s", "-", "")
			}
		}
		fmt.Fprintln(w)
	}
	var ratios [][2]string
	for _, p := range drainRatios {
		if slices.Contains(vs, p[0]) && slices.Contains(vs, p[1]) {
			ratios = append(ratios, p)
		}
	}
	if len(ratios) > 0 {
		fmt.Fprintln(w, "  ratios: msgs/s (consumer µs of CPU per message)")
		for _, p := range ratios {
			fmt.Fprintf(w, "  %-22s", columnTitles[p[0]]+"/"+columnTitles[p[1]])
			for _, c := range cfg.concurrency {
				num, okNum := entry(p[0], c)
				den, okDen := entry(p[1], c)
				if !okNum || !okDen || num.MsgsPerS == 0 || den.MsgsPerS == 0 {
					fmt.Fprintf(w, " %-19s", "  -")
					continue
				}
				cell := fmt.Sprintf("%5.2f", num.MsgsPerS/den.MsgsPerS)
				if a, b := num.CPUPerMsg["consumer"], den.CPUPerMsg["consumer"]; a > 0 && b > 0 {
					cell += fmt.Sprintf(" (%.2f)", a/b)
				}
				fmt.Fprintf(w, " %-19s", cell)
			}
			fmt.Fprintln(w)
		}
	}
	if scenario != scenarioDrain {
		return
	}
	c := slices.Max(cfg.concurrency)
	var rows []Entry
	for _, v := range vs {
		if e, ok := entry(v, c); ok && v != vDBLimit && v != vDBLimitGo {
			rows = append(rows, e)
		}
	}
	if len(rows) > 0 {
		fmt.Fprintf(w, "  at c=%d, per message:\n", c)
		printResources(w, st, rows, func(e Entry) string { return columnTitles[e.Mode] })
	}
}

// printResources prints where the CPU of each entry went: cores busy, µs of CPU per message
// of the consumer, the broker and the database (when they run in processes of their own),
// transactions and WAL syncs per message, peak RSS.
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
	fmt.Fprintf(w, " %8s %9s %8s\n", "commits", "WAL sync", "RSS MiB")
	for _, e := range rows {
		fmt.Fprintf(w, "  %-14s %9.0f %6.2f %12.0f", label(e), e.MsgsPerS, e.CPU["machine"], e.CPUPerMsg["consumer"])
		for _, g := range groups {
			fmt.Fprintf(w, " %12.0f", e.CPUPerMsg[g])
		}
		wal := "-"
		if e.WALSyncsPerMsg > 0 {
			wal = fmt.Sprintf("%.3f", e.WALSyncsPerMsg)
		}
		fmt.Fprintf(w, " %8.3f %9s %8.1f\n", e.CommitsPerMsg, wal, e.PeakRSSMiB)
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
	db := databaseGroup(st.Database)
	for _, rate := range cfg.rates {
		for _, c := range cfg.steadyConc {
			var rows []Entry
			for _, v := range cfg.steadyVariants {
				if e, ok := steadyEntry(ms, st, v, c, rate); ok {
					rows = append(rows, e)
				}
			}
			if len(rows) == 0 {
				continue
			}
			fmt.Fprintf(w, "  steady state at c=%d, %g msgs/s offered for %g s after %g s: latency from publish to commit (ms), µs of CPU per message\n",
				c, rate, cfg.steadySeconds, cfg.steadyWarmup)
			fmt.Fprintf(w, "  %-14s %9s %8s %8s %8s %6s %10s", "", "commits/s", "p50", "p99", "max", "cores", "consumer")
			if db != "" {
				fmt.Fprintf(w, " %10s", db)
			}
			fmt.Fprintln(w)
			for _, e := range rows {
				fmt.Fprintf(w, "  %-14s %9.0f %8.1f %8.1f %8.1f %6.2f %10.0f", columnTitles[e.Mode], e.MsgsPerS,
					e.LatencyP50Ms, e.LatencyP99Ms, e.LatencyMaxMs, e.CPU["machine"], e.CPUPerMsg["consumer"])
				if db != "" {
					fmt.Fprintf(w, " %10.0f", e.CPUPerMsg[db])
				}
				fmt.Fprintln(w)
			}
		}
	}
}

// scenarioRows returns the median entries of a scenario run at one concurrency, in the order
// of variants.
func scenarioRows(ms []Entry, st setup, scenario string, variants []string, c int) []Entry {
	var rows []Entry
	for _, v := range variants {
		if e, ok := find(ms, cell{st: st, variant: v, c: c, scenario: scenario}.name()); ok {
			rows = append(rows, e)
		}
	}
	return rows
}

func printSlow(w io.Writer, cfg suiteConfig, st setup, ms []Entry) {
	rows := scenarioRows(ms, st, scenarioSlow, cfg.slowVariants, cfg.slowConc)
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "  slow processor (waits %s per call: per message, per batch for batch+GC), backlog drain at c=%d:\n", cfg.slowWait, cfg.slowConc)
	printResources(w, st, rows, func(e Entry) string { return columnTitles[e.Mode] })
}

// printReruns prints the reruns scenario: how often each variant's processor ran per message
// when 1 message in cfg.failEvery failed once.
func printReruns(w io.Writer, cfg suiteConfig, st setup, ms []Entry) {
	rows := scenarioRows(ms, st, scenarioReruns, cfg.rerunVariants, cfg.rerunConc)
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "  reruns: 1 message in %d fails once, after its write; backlog drain at c=%d (reruns: runs beyond the first of messages that did not fail, per 1,000):\n",
		cfg.failEvery, cfg.rerunConc)
	fmt.Fprintf(w, "  %-14s %9s %7s %10s %8s %8s %12s\n", "", "msgs/s", "failed", "calls/msg", "reruns", "commits", "consumer µs")
	for _, e := range rows {
		fmt.Fprintf(w, "  %-14s %9.0f %7d %10.4f %8.1f %8.3f %12.0f\n", columnTitles[e.Mode], e.MsgsPerS, e.FailuresInjected,
			e.ProcessorCallsPerMsg, e.RerunsPer1000, e.CommitsPerMsg, e.CPUPerMsg["consumer"])
	}
}
