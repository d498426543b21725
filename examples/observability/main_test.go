package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.buf.Bytes())
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}

// sample returns the value of the sample of family whose labels include every one of labels
// (`name="value"` pairs), or -1 when there is none.
func sample(exposition, family string, labels ...string) float64 {
	for _, line := range strings.Split(exposition, "\n") {
		if !strings.HasPrefix(line, family+"{") && !strings.HasPrefix(line, family+" ") {
			continue
		}
		matches := true
		for _, l := range labels {
			matches = matches && strings.Contains(line, l)
		}
		if !matches {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err == nil {
			return v
		}
	}
	return -1
}

// One database after the other: the service sets the global OpenTelemetry providers.
func TestObservability_ServesOnceflowMetricsAndWritesTraces(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			serve(t, d.URL(t))
		})
	}
}

func serve(t *testing.T, dbURL string) {
	const orders = 3
	traces := &lockedBuffer{}
	addrCh := make(chan string, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Options{
			Addr:      "127.0.0.1:0",
			Dir:       t.TempDir(),
			DBURL:     dbURL,
			Orders:    orders,
			Traces:    traces,
			Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
			Listening: func(addr string) { addrCh <- addr },
		})
	}()
	var addr string
	select {
	case addr = <-addrCh:
	case err := <-done:
		t.Fatalf("service stopped: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("service did not listen")
	}

	// Scrape as Prometheus does until every shipment has been consumed: orders + the flaky one.
	var body string
	deadline := time.Now().Add(30 * time.Second)
	for {
		body = scrape(t, addr)
		if sample(body, "onceflow_messages_total", `onceflow_handler="shipments"`, `onceflow_outcome="processed"`) == orders+1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("shipments not all processed; last scrape:\n%s", body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Scraped again: one scrape reads the gauges and the counters one after the other, so the
	// one that saw the last shipment counted may have read the dedup table before its commit.
	body = scrape(t, addr)

	for _, family := range []string{
		"onceflow_messages_total", "onceflow_process_duration_seconds_bucket", "onceflow_inflight",
		"onceflow_retries_total", "onceflow_commit_to_ack_duration_seconds_bucket", "onceflow_ack_failures_total",
		"onceflow_dedup_rows", "onceflow_dedup_expired", "onceflow_dedup_oldest_age_seconds",
		"onceflow_outbox_backlog", "onceflow_outbox_lag_seconds",
	} {
		require.Contains(t, body, "\n"+family+"{", "metric family %s missing", family)
	}
	// Every metric the Grafana dashboard queries is exported.
	dashboard, err := os.ReadFile("../../docs/grafana-dashboard.json")
	require.NoError(t, err)
	queried := regexp.MustCompile(`onceflow_[a-z_]+`).FindAllString(string(dashboard), -1)
	require.NotEmpty(t, queried)
	for _, name := range queried {
		if strings.HasPrefix(name, "onceflow_handler") || strings.HasPrefix(name, "onceflow_outcome") ||
			strings.HasPrefix(name, "onceflow_dedup_table") || name == "onceflow_outbox_consumer_group" ||
			name == "onceflow_reason" || strings.HasPrefix(name, "onceflow_order_gap_") {
			continue // labels
		}
		if strings.HasPrefix(name, "onceflow_order_") {
			continue // ExactlyOnceInOrder handlers only; the example has none
		}
		if name == "onceflow_outbox" {
			continue // a label too
		}
		require.Contains(t, body, "\n"+name+"{", "the dashboard queries %s, which the service does not export", name)
	}

	orderOutcome := func(o string) float64 {
		return sample(body, "onceflow_messages_total", `onceflow_handler="orders"`, `onceflow_outcome="`+o+`"`)
	}
	require.Equal(t, float64(orders+1), orderOutcome("processed"))
	require.Equal(t, 1.0, orderOutcome("duplicate"))
	require.Equal(t, 1.0, orderOutcome("dead_lettered"))
	require.Equal(t, 0.0, orderOutcome("failed"))
	require.Equal(t, 1.0, sample(body, "onceflow_retries_total", `onceflow_handler="orders"`))
	require.Equal(t, 0.0, sample(body, "onceflow_inflight", `onceflow_handler="orders"`))
	require.Equal(t, float64(orders+1), sample(body, "onceflow_commit_to_ack_duration_seconds_count", `onceflow_handler="orders"`))
	require.Equal(t, float64(2*(orders+1)), sample(body, "onceflow_dedup_rows", `onceflow_dedup_table="onceflow_dedup"`),
		"one key per processed order and per shipment")

	cancel()
	require.NoError(t, <-done)

	// Every span was written to stdout as JSON; the shipments' consumer spans continue the
	// orders' traces through the outbox.
	type span struct {
		Name        string
		SpanContext struct{ TraceID, SpanID string }
		Parent      struct{ TraceID, SpanID string }
	}
	var spans []span
	dec := json.NewDecoder(bytes.NewReader(traces.Bytes()))
	for {
		var s span
		if err := dec.Decode(&s); errors.Is(err, io.EOF) {
			break
		} else {
			require.NoError(t, err)
		}
		spans = append(spans, s)
	}
	names := map[string]int{}
	processSpans := map[string]span{}
	for _, s := range spans {
		names[s.Name]++
		if s.Name == "onceflow.process" {
			processSpans[s.SpanContext.SpanID] = s
		}
	}
	for _, name := range []string{"send orders", "process orders", "process shipments", "onceflow.dedup", "onceflow.process", "onceflow.commit", "ack orders"} {
		require.Positive(t, names[name], "no %q span in the traces", name)
	}
	for _, s := range spans {
		if s.Name != "process shipments" {
			continue
		}
		parent, ok := processSpans[s.Parent.SpanID]
		require.True(t, ok, "the parent of a shipment's consumer span is the orders handler's onceflow.process span")
		require.Equal(t, parent.SpanContext.TraceID, s.SpanContext.TraceID)
	}
}

// TestAlerts_AreValidRulesOverDocumentedMetrics checks docs/alerts.yml with promtool, when it is
// installed, and that every metric the rules query is one docs/observability.md lists.
func TestAlerts_AreValidRulesOverDocumentedMetrics(t *testing.T) {
	rules, err := os.ReadFile("../../docs/alerts.yml")
	require.NoError(t, err)
	doc, err := os.ReadFile("../../docs/observability.md")
	require.NoError(t, err)
	labels := map[string]bool{"onceflow_handler": true, "onceflow_outcome": true, "onceflow_reason": true,
		"onceflow_outbox": true, "onceflow_outbox_consumer_group": true, "onceflow_dedup_table": true}
	for _, name := range regexp.MustCompile(`onceflow_[a-z_]+`).FindAllString(string(rules), -1) {
		if labels[name] {
			continue
		}
		require.Contains(t, string(doc), "`"+name+"`", "docs/alerts.yml queries %s, which docs/observability.md does not list", name)
	}

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool is not installed: the rules' syntax is not checked (apt-get install prometheus, or go install github.com/prometheus/prometheus/cmd/promtool)")
	}
	out, err := exec.Command(promtool, "check", "rules", "../../docs/alerts.yml").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "SUCCESS")
}
