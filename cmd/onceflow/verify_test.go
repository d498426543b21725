package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

// TestMain lets the test binary stand in for the onceflow command when verify starts its
// consumer processes: verify runs os.Executable() with the argument "verify-consumer".
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "verify-consumer" {
		cmd := newRootCommand()
		cmd.SetArgs(os.Args[1:])
		if err := cmd.ExecuteContext(context.Background()); err != nil {
			os.Stderr.WriteString("verify-consumer: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type verifyJSON struct {
	Modes []struct {
		Mode       string         `json:"mode"`
		Messages   int            `json:"messages"`
		Kills      int            `json:"kills"`
		Cuts       int            `json:"connection_cuts"`
		Lost       int            `json:"lost"`
		Duplicated int            `json:"duplicated"`
		Crashes    map[string]int `json:"crash_point_kills"`
		OutOfOrder *int           `json:"order_violations"`
		MsgsPerS   float64        `json:"msgs_per_s"`
	} `json:"modes"`
}

// runVerify runs a short verification and decodes its JSON report; stdout must hold that JSON
// object and nothing else.
func runVerify(t *testing.T, args ...string) verifyJSON {
	t.Helper()
	cmd := newRootCommand()
	var stdout, stderr bytes.Buffer
	cmd.SetOut(&stdout)
	cmd.SetErr(&stderr)
	dir := t.TempDir()
	cmd.SetArgs(append([]string{"verify", "--json", "--messages", "2000", "--kills", "5", "--dir", dir}, args...))
	err := cmd.ExecuteContext(context.Background())
	if err != nil {
		logs, _ := filepath.Glob(filepath.Join(dir, "*.log"))
		for _, l := range logs {
			b, _ := os.ReadFile(l)
			t.Logf("%s:\n%s", filepath.Base(l), b[max(0, len(b)-3000):])
		}
	}
	require.NoError(t, err, "report: %s\nstderr: %s", stdout.String(), stderr.String())

	var report verifyJSON
	dec := json.NewDecoder(&stdout)
	require.NoError(t, dec.Decode(&report))
	require.False(t, dec.More(), "stdout holds one JSON object and nothing else")
	require.Len(t, report.Modes, 4)
	return report
}

func checkTable(t *testing.T, r verifyJSON, wantCuts bool) {
	t.Helper()
	byMode := map[string]int{}
	for i, m := range r.Modes {
		byMode[m.Mode] = i
		require.Equal(t, 2000, m.Messages)
		if m.Mode != "BestEffort" { // it loses messages, so progress may not reach the last kill marks
			require.GreaterOrEqual(t, m.Kills, 5, "%s: every scheduled kill happened", m.Mode)
		} else {
			require.Positive(t, m.Kills)
		}
		if wantCuts {
			require.Positive(t, m.Cuts, "%s: connections were cut", m.Mode)
		}
		require.Positive(t, m.MsgsPerS)
	}
	exactly := r.Modes[byMode["ExactlyOnce"]]
	require.Zero(t, exactly.Lost, "ExactlyOnce lost messages")
	require.Zero(t, exactly.Duplicated, "ExactlyOnce duplicated effects")
	require.Nil(t, exactly.OutOfOrder, "ExactlyOnce promises no order, and reports none")
	inOrder := r.Modes[byMode["ExactlyOnceInOrder"]]
	require.Zero(t, inOrder.Lost, "ExactlyOnceInOrder lost messages")
	require.Zero(t, inOrder.Duplicated, "ExactlyOnceInOrder duplicated effects")
	require.NotNil(t, inOrder.OutOfOrder)
	require.Zero(t, *inOrder.OutOfOrder, "ExactlyOnceInOrder applied a key's messages out of order")
	atLeast := r.Modes[byMode["AtLeastOnce"]]
	require.Zero(t, atLeast.Lost, "AtLeastOnce lost messages")
	// A consumer killed after its commit and before its ack duplicates the effect without
	// dedup. A random kill may do it too, but only the armed crash point is certain to; it
	// fires unless the run ends before the armed consumer receives its next messages.
	if atLeast.Crashes["after-commit"] > 0 {
		require.Positive(t, atLeast.Duplicated, "a crash after commit, before ack, duplicates without dedup")
	} else {
		t.Logf("AtLeastOnce: the after-commit crash point did not fire (%d duplicated)", atLeast.Duplicated)
	}
	require.Positive(t, r.Modes[byMode["BestEffort"]].Lost, "acking on receipt loses the messages in flight at a kill")
}

func TestVerify_EmbeddedDefaultReproducesTheSeedTable(t *testing.T) {
	checkTable(t, runVerify(t), false)
}

func TestVerify_RabbitMQAndPostgreSQLReproduceTheSeedTable(t *testing.T) {
	amqpURL := testsvc.AMQPURL(t)
	dbURL := testsvc.PostgresSchemaURL(t)
	checkTable(t, runVerify(t, "--broker", amqpURL, "--db", dbURL, "--cuts", "3"), true)
}
