package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRun_EmbeddedSmoke runs the suite's plumbing on the embedded setup, which needs no
// service, with a handful of messages: every variant of every scenario produces an entry
// without error, the results file holds them with medians and targets, and the chart is
// written. It measures nothing.
func TestRun_EmbeddedSmoke(t *testing.T) {
	dir := t.TempDir()
	out, chart := filepath.Join(dir, "latest.json"), filepath.Join(dir, "performance.svg")
	err := run(context.Background(), []string{"run",
		"-setups", "sqlite", "-concurrency", "1,4", "-gc-prefetch", "10", "-gc-prefetch-concurrency", "1,4",
		"-steady-concurrency", "4", "-steady-variants", "exactlyonce,exactlyonce-gc,batch-gc,expert", "-rate", "200", "-steady-seconds", "0.3", "-steady-warmup", "0.2",
		"-slow-setups", "sqlite", "-slow-concurrency", "4", "-slow-wait", "1ms",
		"-rounds", "1", "-seconds", "0.2", "-min-messages", "200", "-max-messages", "200",
		"-dir", dir, "-out", out, "-chart", chart})
	require.NoError(t, err)

	b, err := os.ReadFile(out)
	require.NoError(t, err)
	var res Results
	require.NoError(t, json.Unmarshal(b, &res))
	// drain: 2 concurrencies x (6 variants + 1 prefetch of the sweep); steady: 4; slow: 3
	require.Len(t, res.Entries, 21)
	scenarios := map[string]int{}
	for _, e := range res.Entries {
		require.Empty(t, e.Error, e.Name)
		require.Positive(t, e.MsgsPerS, e.Name)
		require.Equal(t, "sqlite", e.Database, e.Name)
		scenarios[e.Scenario]++
		if e.Scenario == scenarioSteady {
			require.Positive(t, e.LatencyP99Ms, e.Name)
		}
		if e.Scenario == scenarioDrain {
			// The commits of the application file per message: one per message without
			// groups, fewer with them.
			switch e.Mode {
			case vExactlyOnce, vBaseline:
				require.InDelta(t, 1, e.WALSyncsPerMsg, 0.05, e.Name)
			case vGroupCommit, vBatch, vExpert:
				require.Positive(t, e.WALSyncsPerMsg, e.Name)
				require.Less(t, e.WALSyncsPerMsg, 1.0, e.Name)
			}
		}
	}
	require.Equal(t, map[string]int{scenarioDrain: 14, scenarioSteady: 4, scenarioSlow: 3}, scenarios)
	require.Len(t, res.Medians, 21)
	require.NotEmpty(t, res.Targets)
	svg, err := os.ReadFile(chart)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(strings.TrimSpace(string(svg)), "<?xml"), "an SVG file")
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
	st := allSetups[0]
	cfg := suiteConfig{setups: []setup{st}, concurrency: []int{16}, steadyConc: []int{16}}
	ms := []Entry{
		{Name: "postgres/exactlyonce/c16", MsgsPerS: 2000},
		{Name: "postgres/exactlyonce-gc/c16", MsgsPerS: 6000, CPU: map[string]float64{"machine": 1.95}},
		{Name: "postgres/batch-gc/c16", MsgsPerS: 15000},
		{Name: "postgres/expert/c16", MsgsPerS: 20000},
		{Name: "postgres/watermill/c16", MsgsPerS: 2500},
		{Name: "postgres/steady/exactlyonce/c16", Scenario: scenarioSteady, LatencyP99Ms: 10},
		{Name: "postgres/steady/exactlyonce-gc/c16", Scenario: scenarioSteady, LatencyP99Ms: 11},
	}
	ts := evaluateTargets(cfg, ms)
	got := map[string]bool{}
	for _, tg := range ts {
		got[tg.Target] = tg.Met
		if !tg.Met {
			require.NotEmpty(t, tg.Binding, tg.Target)
		}
	}
	require.Equal(t, map[string]bool{
		"batch+GC >= 1.0x expert":       false, // 0.75
		"EO+GC >= 0.5x expert":          false, // 0.3
		"EO+GC >= 4x watermill":         false, // 2.4
		"ExactlyOnce >= 1.0x watermill": false, // 0.8
		steadyP99Target:                 true,  // 11 ms
		steadyP99RatioTarget:            true,  // 1.1
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
