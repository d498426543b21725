package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
)

// medians returns one entry per cell with the median rate of its successful rounds (the lower
// middle one for an even count), and the messages and CPU of that round.
func medians(entries []Entry) []Entry {
	byName := map[string][]Entry{}
	var order []string
	for _, e := range entries {
		if _, seen := byName[e.Name]; !seen {
			order = append(order, e.Name)
		}
		if e.Error == "" {
			byName[e.Name] = append(byName[e.Name], e)
		} else if byName[e.Name] == nil {
			byName[e.Name] = []Entry{}
		}
	}
	var out []Entry
	for _, name := range order {
		es := byName[name]
		if len(es) == 0 {
			continue
		}
		slices.SortFunc(es, func(a, b Entry) int {
			switch {
			case a.MsgsPerS < b.MsgsPerS:
				return -1
			case a.MsgsPerS > b.MsgsPerS:
				return 1
			}
			return 0
		})
		m := es[(len(es)-1)/2]
		m.Round = 0
		out = append(out, m)
	}
	return out
}

func rateOf(ms []Entry, st setup, v string, c int) float64 {
	name := fmt.Sprintf("%s/%s/c%d", st.Name, v, c)
	for _, e := range ms {
		if e.Name == name {
			return e.MsgsPerS
		}
	}
	return 0
}

// Target is one of the targets, evaluated on the medians of one setup at one
// concurrency.
type Target struct {
	Setup       string  `json:"setup"`
	Concurrency int     `json:"concurrency"`
	Target      string  `json:"target"`
	Ratio       float64 `json:"ratio"`
	Want        float64 `json:"want"`
	Met         bool    `json:"met"`
}

// targetDefs are the targets: a ratio of two variants' medians, and its threshold.
var targetDefs = []struct {
	name     string
	num, den string
	want     float64
	only     int // the concurrency it applies to; 0 for every one
}{
	{"ExactlyOnce >= 0.95x hand-written watermill baseline", vExactlyOnce, vBaseline, 0.95, 0},
	{"ExactlyOnce <= 10% slower than AtLeastOnce", vExactlyOnce, vAtLeastOnce, 0.90, 0},
	{"group commit >= 5x ExactlyOnce per message", vGroupCommit, vExactlyOnce, 5, 16},
	{"ExactlyOnce >= 80% of the database's own rate", vExactlyOnce, vDBLimit, 0.80, 0},
}

func evaluateTargets(setups []setup, conc []int, ms []Entry) []Target {
	var out []Target
	for _, st := range setups {
		for _, d := range targetDefs {
			for _, c := range conc {
				if d.only != 0 && c != d.only {
					continue
				}
				num, den := rateOf(ms, st, d.num, c), rateOf(ms, st, d.den, c)
				if num == 0 || den == 0 {
					continue
				}
				r := num / den
				out = append(out, Target{Setup: st.Name, Concurrency: c, Target: d.name, Ratio: round2(r), Want: d.want, Met: r >= d.want})
			}
		}
	}
	return out
}

var columnTitles = map[string]string{
	vAtLeastOnce: "AtLeastOnce",
	vExactlyOnce: "ExactlyOnce",
	vGroupCommit: "EO+group",
	vBaseline:    "watermill",
	vDBLimit:     "db-limit",
	vDBLimitGo:   "db-limit-go",
}

// printReport prints, per setup, the median msgs/s of every variant and the target ratios.
func printReport(w io.Writer, setups []setup, conc []int, res Results) {
	rounds := res.Config["rounds"]
	fmt.Fprintf(w, "\nonceflow end-to-end benchmark, %s, %d cores (%s), load average %.2f -> %.2f\n",
		res.Date, res.Machine.Cores, res.Machine.CPU, res.Machine.LoadBefore, res.Machine.LoadAfter)
	for _, st := range setups {
		vs := []string{}
		for _, v := range allVariants {
			if slices.ContainsFunc(res.Medians, func(e Entry) bool {
				return e.Mode == v && e.Database == st.Database && strings.HasPrefix(e.Name, st.Name+"/")
			}) {
				vs = append(vs, v)
			}
		}
		if len(vs) == 0 {
			continue
		}
		tool := "go-loop"
		if st.Database == "postgres" {
			tool = "pgbench"
		}
		fmt.Fprintf(w, "\n%s: msgs/s, median of %v rounds (db-limit: %s)\n", st.Title, rounds, tool)
		fmt.Fprintf(w, "%6s", "conc")
		for _, v := range vs {
			fmt.Fprintf(w, " %12s", columnTitles[v])
		}
		fmt.Fprintf(w, " | %8s %8s %8s %8s\n", "EO/wm", "EO/ALO", "GC/EO", "EO/db")
		for _, c := range conc {
			fmt.Fprintf(w, "%6d", c)
			for _, v := range vs {
				if r := rateOf(res.Medians, st, v, c); r > 0 {
					fmt.Fprintf(w, " %12.0f", r)
				} else {
					fmt.Fprintf(w, " %12s", "-")
				}
			}
			fmt.Fprint(w, " |")
			for _, pair := range [][2]string{{vExactlyOnce, vBaseline}, {vExactlyOnce, vAtLeastOnce}, {vGroupCommit, vExactlyOnce}, {vExactlyOnce, vDBLimit}} {
				num, den := rateOf(res.Medians, st, pair[0], c), rateOf(res.Medians, st, pair[1], c)
				if num > 0 && den > 0 {
					fmt.Fprintf(w, " %8.2f", num/den)
				} else {
					fmt.Fprintf(w, " %8s", "-")
				}
			}
			fmt.Fprintln(w)
		}
	}
	if len(res.Targets) > 0 {
		fmt.Fprintf(w, "\ntargets (ratios of medians measured side by side in this run):\n")
		for _, t := range res.Targets {
			mark := "met"
			if !t.Met {
				mark = "NOT MET"
			}
			fmt.Fprintf(w, "  %-8s c=%-3d %-55s %6.2f (want >= %.2f)  %s\n", t.Setup, t.Concurrency, t.Target, t.Ratio, t.Want, mark)
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
