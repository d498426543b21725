package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRun_EmbeddedSmoke runs the suite's plumbing on the embedded setup, which needs no
// service, with a handful of messages: every variant of every scenario produces an entry
// without error, the results file holds them with medians and targets, and the chart is
// written. It measures nothing, but it counts: a transaction per message commits once per
// message, and its processor runs once per message plus once more for each message that
// failed, where no other message runs again.
func TestRun_EmbeddedSmoke(t *testing.T) {
	dir := t.TempDir()
	out, chart := filepath.Join(dir, "latest.json"), filepath.Join(dir, "performance.svg")
	err := run(context.Background(), []string{"run",
		"-setups", "sqlite", "-concurrency", "1,4", "-gc-prefetch", "10", "-gc-prefetch-concurrency", "1,4",
		"-small-payload", "100",
		"-steady-setups", "sqlite", "-steady-concurrency", "4", "-steady-variants", "default,expert",
		"-rate", "200", "-steady-seconds", "0.3", "-steady-warmup", "0.2",
		"-slow-setups", "sqlite", "-slow-concurrency", "4", "-slow-wait", "1ms", "-slow-variants", "default,batch-gc",
		"-rerun-setups", "sqlite", "-rerun-concurrency", "4", "-fail-every", "10", "-rerun-messages", "200",
		"-rerun-variants", "exactlyonce,exactlyonce-gc,batch-gc",
		"-rounds", "1", "-seconds", "0.2", "-min-messages", "200", "-max-messages", "200",
		"-dir", dir, "-out", out, "-chart", chart})
	require.NoError(t, err)

	b, err := os.ReadFile(out)
	require.NoError(t, err)
	var res Results
	require.NoError(t, json.Unmarshal(b, &res))
	// drain: 2 concurrencies x (7 variants + 1 prefetch of the sweep); small: 2 x 2;
	// steady: 2; slow: 2; reruns: 3
	require.Len(t, res.Entries, 27)
	scenarios := map[string]int{}
	for _, e := range res.Entries {
		require.Empty(t, e.Error, e.Name)
		require.Positive(t, e.MsgsPerS, e.Name)
		require.Equal(t, "sqlite", e.Database, e.Name)
		scenarios[e.Scenario]++
		wantPayload := 1024
		if e.Scenario == scenarioSmall {
			wantPayload = 100
		}
		require.Equal(t, wantPayload, e.PayloadBytes, e.Name)
		if e.Mode == vDefault {
			require.Zero(t, e.Prefetch, "%s: the default variant leaves the prefetch to the broker", e.Name)
		}
		if e.Scenario == scenarioSteady {
			require.Positive(t, e.LatencyP99Ms, e.Name)
		}
		if e.Mode == vDBLimit {
			continue
		}
		// The commits of the application file per message: one per message without groups,
		// fewer with them.
		switch e.Mode {
		case vExactlyOnce, vBaseline:
			require.InDelta(t, 1, e.CommitsPerMsg, 0.001, e.Name)
			require.Equal(t, e.CommitsPerMsg, e.WALSyncsPerMsg, e.Name)
		case vGroupCommit, vBatch, vExpert:
			require.Positive(t, e.CommitsPerMsg, e.Name)
			if e.Scenario != scenarioSteady { // at a light rate a group may hold one message
				require.Less(t, e.CommitsPerMsg, 1.0, e.Name)
			}
		}
		if e.Scenario == scenarioReruns {
			// 1 in 10 by a hash of 200 random ids: none failing is a chance of 1 in 10^9.
			require.Positive(t, e.FailuresInjected, e.Name)
			require.GreaterOrEqual(t, e.ProcessorCallsPerMsg, 1+float64(e.FailuresInjected)/200, e.Name)
			if e.Mode == vExactlyOnce {
				require.Zero(t, e.RerunsPer1000, "%s: a transaction per message runs no message again for another's failure", e.Name)
			}
		}
	}
	require.Equal(t, map[string]int{scenarioDrain: 16, scenarioSmall: 4, scenarioSteady: 2, scenarioSlow: 2, scenarioReruns: 3}, scenarios)
	require.Len(t, res.Medians, 27)
	require.NotEmpty(t, res.Targets)
	svg, err := os.ReadFile(chart)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(strings.TrimSpace(string(svg)), "<?xml"), "an SVG file")
}

func TestPerMsg_TruncatesAnExactQuotientToItself(t *testing.T) {
	require.Equal(t, 1.13, perMsg(226, 200, 10000)) // in floats, 226/200*10000 is 11299.99...
	require.Equal(t, 0.999, perMsg(9999, 10000, 1000))
	require.Equal(t, 0.0, perMsg(5, 0, 1000))
}

func TestMedians_TakesTheMiddleRoundAndSkipsFailures(t *testing.T) {
	es := []Entry{
		{Name: "a", MsgsPerS: 300, Round: 1},
		{Name: "a", MsgsPerS: 100, Round: 2},
		{Name: "a", MsgsPerS: 200, Round: 3},
		{Name: "b", MsgsPerS: 50, Round: 1},
		{Name: "b", Error: "boom", Round: 2},
		{Name: "c", Error: "boom", Round: 1},
	}
	ms := medians(es)
	require.Len(t, ms, 2)
	require.Equal(t, "a", ms[0].Name)
	require.Equal(t, 200.0, ms[0].MsgsPerS)
	require.Equal(t, 50.0, ms[1].MsgsPerS)
}

func TestMedians_SteadyStateTakesTheMedianLatency(t *testing.T) {
	es := []Entry{
		{Name: "s", Scenario: scenarioSteady, MsgsPerS: 1000, LatencyP99Ms: 9, Round: 1},
		{Name: "s", Scenario: scenarioSteady, MsgsPerS: 990, LatencyP99Ms: 30, Round: 2},
		{Name: "s", Scenario: scenarioSteady, MsgsPerS: 1010, LatencyP99Ms: 12, Round: 3},
	}
	ms := medians(es)
	require.Len(t, ms, 1)
	require.Equal(t, 12.0, ms[0].LatencyP99Ms)
}

func TestEvaluateTargets_RatiosOfMedians(t *testing.T) {
	pg, nats := allSetups[0], allSetups[2]
	require.Equal(t, []string{"postgres", "nats"}, []string{pg.Name, nats.Name})
	cfg := suiteConfig{setups: []setup{pg, nats}, concurrency: []int{16}, steadyConc: []int{16}, rates: []float64{1000},
		steadyVariants: steadyVariants, payloadSize: 1024, smallPayload: 100}
	busy := map[string]float64{"machine": 1.95}
	cpu := func(us float64) map[string]float64 { return map[string]float64{"consumer": us} }
	ms := []Entry{
		{Name: "postgres/default/c16", MsgsPerS: 4000, CPU: busy},
		{Name: "postgres/exactlyonce/c16", MsgsPerS: 2000},
		{Name: "postgres/exactlyonce-gc/c16", MsgsPerS: 6000, CPU: busy},
		{Name: "postgres/batch-gc/c16", MsgsPerS: 15000},
		{Name: "postgres/expert/c16", MsgsPerS: 20000},
		{Name: "postgres/watermill/c16", MsgsPerS: 2500},
		{Name: "postgres/small/batch-gc/c16", MsgsPerS: 30000, CPUPerMsg: cpu(12)},
		{Name: "postgres/small/expert/c16", MsgsPerS: 29000, CPUPerMsg: cpu(10)},
		{Name: "postgres/steady@1000/default/c16", Scenario: scenarioSteady, LatencyP99Ms: 25},
		{Name: "postgres/steady@1000/exactlyonce/c16", Scenario: scenarioSteady, LatencyP99Ms: 10},
		{Name: "postgres/steady@1000/exactlyonce-gc/c16", Scenario: scenarioSteady, LatencyP99Ms: 11},
		{Name: "nats/default/c16", MsgsPerS: 12000},
		{Name: "nats/expert/c16", MsgsPerS: 20000},
		{Name: "nats/small/batch-gc/c16", MsgsPerS: 19000, CPUPerMsg: cpu(10.5)},
		{Name: "nats/small/expert/c16", MsgsPerS: 20000, CPUPerMsg: cpu(10)},
	}
	got := map[string]bool{}
	for _, tg := range evaluateTargets(cfg, ms) {
		key := fmt.Sprintf("%s %s %s", tg.Setup, tg.where(), tg.Target)
		require.NotContains(t, got, key)
		got[key] = tg.Met
		if !tg.Met {
			require.NotEmpty(t, tg.Binding, key)
		}
	}
	require.Equal(t, map[string]bool{
		"postgres 1024 B default >= 0.5x expert":                  false, // 0.2
		"nats 1024 B default >= 0.5x expert":                      true,  // 0.6
		"postgres 100 B batch+GC >= 1.0x expert":                  true,  // 1.03
		"nats 100 B batch+GC >= 1.0x expert":                      false, // 0.95
		"postgres 100 B batch+GC consumer CPU/msg <= 1.1x expert": false, // 1.2
		"nats 100 B batch+GC consumer CPU/msg <= 1.1x expert":     true,  // 1.05
		"postgres 1024 B batch+GC >= 1.0x expert":                 false, // 0.75
		"postgres 1024 B EO+GC >= 0.5x expert":                    false, // 0.3
		"postgres 1024 B EO+GC >= 4x watermill":                   false, // 2.4
		"postgres 1024 B ExactlyOnce >= 1.0x watermill":           false, // 0.8
		"postgres 1000/s steady p99 default <= 20 ms":             false, // 25 ms
		"postgres 1000/s steady p99 EO+GC <= 20 ms":               true,  // 11 ms
		"postgres 1000/s " + steadyP99RatioTarget:                 true,  // 1.1
	}, got)
}

func TestBinding_NamesTheResource(t *testing.T) {
	st := allSetups[0]
	expert := Entry{MsgsPerS: 20000, CPU: map[string]float64{"machine": 1.9}, CPUPerMsg: map[string]float64{"consumer": 30, "rabbitmq": 20, "postgres": 25}}
	busy := Entry{MsgsPerS: 6000, CPU: map[string]float64{"machine": 1.95}, CPUPerMsg: map[string]float64{"consumer": 120, "rabbitmq": 25, "postgres": 30}}
	require.Contains(t, binding(st, busy, expert), "CPU: 1.95 of")
	require.Contains(t, binding(st, busy, expert), "consumer 120 (expert 30)")
	idle := Entry{MsgsPerS: 3000, CPU: map[string]float64{"machine": 0.8}}
	require.Contains(t, binding(st, idle, expert), "waiting, not CPU")
	syncs := Entry{MsgsPerS: 3000, CPU: map[string]float64{"machine": 0.8}, WALSyncsPerMsg: 0.5}
	require.Contains(t, binding(st, syncs, expert), "commits: 0.500 WAL syncs")
	embedded := allSetups[len(allSetups)-1]
	require.Equal(t, "sqlite", embedded.Database)
	require.Contains(t, binding(embedded, idle, expert), "one writer: SQLite runs the write transactions")
	require.Contains(t, binding(embedded, busy, expert), "CPU: 1.95 of")
}

func TestPrintDrain_PrintsTheCPUPerMessageBesideEveryRate(t *testing.T) {
	st := allSetups[0]
	cfg := suiteConfig{setups: []setup{st}, concurrency: []int{1, 16}, rounds: 3}
	cpu := func(consumer, db float64) map[string]float64 {
		return map[string]float64{"consumer": consumer, "postgres": db}
	}
	ms := []Entry{
		{Name: "postgres/default/c1", MsgsPerS: 1400, CPUPerMsg: cpu(150, 60)},
		{Name: "postgres/default/c16", MsgsPerS: 4200, CPUPerMsg: cpu(151, 61)},
		{Name: "postgres/expert/c1", MsgsPerS: 14000, CPUPerMsg: cpu(30, 20)},
		{Name: "postgres/expert/c16", MsgsPerS: 21000, CPUPerMsg: cpu(16, 19)},
		{Name: "postgres/small/expert/c16", MsgsPerS: 40000, CPUPerMsg: cpu(8, 10)},
	}
	var b strings.Builder
	printDrain(&b, cfg, st, ms, scenarioDrain, 1024)
	out := b.String()
	require.Contains(t, out, "RabbitMQ -> PostgreSQL: backlog drain, 1024 B payloads")
	require.Regexp(t, `\n  default +1400 150/60 +4200 151/61 *\n`, out)
	require.Regexp(t, `\n  expert +14000 30/20 +21000 16/19 *\n`, out)
	require.Regexp(t, `\n  default/expert +0\.10 \(5\.00\) +0\.20 \(9\.44\) *\n`, out)
	require.NotContains(t, out, "40000", "the small payloads' cells are a table of their own")

	b.Reset()
	printDrain(&b, cfg, st, ms, scenarioSmall, 100)
	require.Regexp(t, `100 B payloads(.|\n)*\n  expert +- +40000 8/10 *\n`, b.String())
}

func TestFaults_FailTheChosenMessagesOnce(t *testing.T) {
	every := &faults{every: 1} // every message is chosen
	require.True(t, every.fail("a"))
	require.False(t, every.fail("a"), "a message fails its first run only")
	require.True(t, every.fail("b"))
	require.Equal(t, int64(2), every.injected())

	var none *faults
	require.False(t, none.fail("a"))

	// 1 in 1,000 by a hash of the id: about 200 of 200,000 ids, and the same ones each time.
	some, again := &faults{every: 1000}, &faults{every: 1000}
	chosen, differ := 0, 0
	for i := range 200_000 {
		id := fmt.Sprintf("id-%d", i)
		first := some.fail(id)
		if first {
			chosen++
		}
		if again.fail(id) != first {
			differ++
		}
	}
	require.InDelta(t, 200, chosen, 60)
	require.Equal(t, int64(chosen), some.injected())
	require.Zero(t, differ, "ids chosen by one and not the other")
}

func TestParseSuiteFlags_AQuickRunWritesApartFromTheRecordedRun(t *testing.T) {
	t.Setenv("BENCH_QUICK", "")
	cfg, _, err := parseSuiteFlags([]string{"-quick"})
	require.NoError(t, err)
	require.Equal(t, quickOut, cfg.out)
	require.Equal(t, quickChart, cfg.chart)
	require.Equal(t, 1, cfg.rounds)

	cfg, _, err = parseSuiteFlags([]string{"-quick", "-out", "x.json", "-rounds", "2"})
	require.NoError(t, err)
	require.Equal(t, "x.json", cfg.out, "a flag set wins over the quick run's default")
	require.Equal(t, quickChart, cfg.chart)
	require.Equal(t, 2, cfg.rounds)

	cfg, _, err = parseSuiteFlags(nil)
	require.NoError(t, err)
	require.Equal(t, "bench/results/latest.json", cfg.out)
	require.Equal(t, "docs/performance.svg", cfg.chart)
}
