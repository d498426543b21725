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
// service, with a handful of messages: every variant produces an entry without error, the
// results file holds them with medians, and the chart is written. It measures nothing.
func TestRun_EmbeddedSmoke(t *testing.T) {
	dir := t.TempDir()
	out, chart := filepath.Join(dir, "latest.json"), filepath.Join(dir, "performance.svg")
	err := run(context.Background(), []string{"run",
		"-setups", "sqlite", "-concurrency", "1,4", "-variants", "atleastonce,exactlyonce,exactlyonce-gc,watermill,db-limit",
		"-rounds", "1", "-seconds", "0.2", "-min-messages", "40", "-max-messages", "40",
		"-dir", dir, "-out", out, "-chart", chart})
	require.NoError(t, err)

	b, err := os.ReadFile(out)
	require.NoError(t, err)
	var res Results
	require.NoError(t, json.Unmarshal(b, &res))
	require.Len(t, res.Entries, 10)
	for _, e := range res.Entries {
		require.Empty(t, e.Error, e.Name)
		require.Positive(t, e.MsgsPerS, e.Name)
		require.Equal(t, "sqlite", e.Database, e.Name)
	}
	require.Len(t, res.Medians, 10)
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

func TestEvaluateTargets_RatiosOfMedians(t *testing.T) {
	st := allSetups[0]
	ms := []Entry{
		{Name: "postgres/exactlyonce/c16", MsgsPerS: 1000},
		{Name: "postgres/watermill/c16", MsgsPerS: 1000},
		{Name: "postgres/atleastonce/c16", MsgsPerS: 1200},
		{Name: "postgres/exactlyonce-gc/c16", MsgsPerS: 6000},
		{Name: "postgres/db-limit/c16", MsgsPerS: 2000},
	}
	ts := evaluateTargets([]setup{st}, []int{16}, ms)
	require.Len(t, ts, 4)
	got := map[string]bool{}
	for _, tg := range ts {
		got[tg.Target] = tg.Met
	}
	require.Equal(t, map[string]bool{
		"ExactlyOnce >= 0.95x hand-written watermill baseline": true,
		"ExactlyOnce <= 10% slower than AtLeastOnce":           false, // 0.83
		"group commit >= 5x ExactlyOnce per message":           true,
		"ExactlyOnce >= 80% of the database's own rate":        false, // 0.5
	}, got)
}
