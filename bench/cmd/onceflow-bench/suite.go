package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// setup is one broker and database pair of the suite.
type setup struct {
	Name     string // postgres, mysql, sqlite
	Broker   string // amqp or sqlite
	Database string // postgres, mysql or sqlite
	Title    string
}

var allSetups = []setup{
	{Name: "postgres", Broker: "amqp", Database: "postgres", Title: "RabbitMQ -> PostgreSQL"},
	{Name: "mysql", Broker: "amqp", Database: "mysql", Title: "RabbitMQ -> MariaDB"},
	{Name: "sqlite", Broker: "sqlite", Database: "sqlite", Title: "embedded: SQLite queue -> SQLite"},
}

// The variants of a cell: onceflow's three modes, the hand-written watermill baseline, and the
// database's own rate for the same statements.
const (
	vAtLeastOnce = "atleastonce"
	vExactlyOnce = "exactlyonce"
	vGroupCommit = "exactlyonce-gc"
	vBaseline    = "watermill"
	vDBLimit     = "db-limit"    // pgbench on PostgreSQL, a Go loop elsewhere
	vDBLimitGo   = "db-limit-go" // a Go loop on PostgreSQL, beside pgbench
)

var allVariants = []string{vAtLeastOnce, vExactlyOnce, vGroupCommit, vBaseline, vDBLimit, vDBLimitGo}

// variantsOf returns the variants that apply to s, in the order given.
func variantsOf(s setup, vs []string) []string {
	var out []string
	for _, v := range vs {
		if v == vDBLimitGo && s.Database != "postgres" {
			continue // elsewhere db-limit is the Go loop already
		}
		out = append(out, v)
	}
	return out
}

// suiteConfig is what `onceflow-bench run` measures.
type suiteConfig struct {
	setups      []setup
	concurrency []int
	variants    []string
	rounds      int
	seconds     float64 // steady state aimed at per cell
	warmup      float64 // fraction of a cell's messages not measured
	minMessages int
	maxMessages int
	payloadSize int
	prefetch    int
	maxIdle     int
	out, chart  string
	profileDir  string
	quick       bool
}

func parseSuiteFlags(args []string) (suiteConfig, services, error) {
	svc := defaultServices()
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	setups := fs.String("setups", "postgres,mysql,sqlite", "broker -> database pairs to measure: postgres (RabbitMQ -> PostgreSQL), mysql (RabbitMQ -> MariaDB), sqlite (embedded SQLite queue -> SQLite)")
	conc := fs.String("concurrency", "1,4,16", "handler concurrencies")
	variants := fs.String("variants", strings.Join(allVariants, ","), "variants to measure")
	rounds := fs.Int("rounds", 3, "rounds; each cell is measured once per round, interleaved, and the median reported")
	seconds := fs.Float64("seconds", 4, "seconds of steady state aimed at per cell (the message count follows from the rate measured so far)")
	warmup := fs.Float64("warmup", 0.15, "fraction of each cell's messages processed before the clock starts")
	minMsgs := fs.Int("min-messages", 1500, "fewest messages per cell")
	maxMsgs := fs.Int("max-messages", 150000, "most messages per cell")
	payload := fs.Int("payload", 1024, "payload bytes per message")
	prefetch := fs.Int("prefetch", 0, "AMQP prefetch per subscription, for onceflow and the baseline alike (0: onceflow's default, 10)")
	maxIdle := fs.Int("max-idle", 0, "database/sql MaxIdleConns of the consumer's pool, for onceflow and the baseline alike (0: as sqldb.Open leaves it)")
	quick := fs.Bool("quick", os.Getenv("BENCH_QUICK") == "1", "a short smoke run: 1 round, 1 s per cell, few messages (also BENCH_QUICK=1)")
	out := fs.String("out", "bench/results/latest.json", "results file")
	chart := fs.String("chart", "docs/performance.svg", "chart file (.svg or .png); empty for none")
	profile := fs.String("cpuprofile-dir", "", "write a CPU profile of each onceflow cell at the highest concurrency into this directory (profiling slows what it measures: not for the reported numbers)")
	fs.StringVar(&svc.postgres, "postgres", svc.postgres, "PostgreSQL URL")
	fs.StringVar(&svc.mysql, "mysql", svc.mysql, "MariaDB/MySQL URL")
	fs.StringVar(&svc.amqp, "amqp", svc.amqp, "RabbitMQ URL")
	fs.StringVar(&svc.dir, "dir", "", "directory for SQLite files (default: a temporary directory, removed at the end)")
	if err := fs.Parse(args); err != nil {
		return suiteConfig{}, svc, err
	}
	cfg := suiteConfig{
		rounds: *rounds, seconds: *seconds, warmup: *warmup, minMessages: *minMsgs, maxMessages: *maxMsgs,
		payloadSize: *payload, prefetch: *prefetch, maxIdle: *maxIdle, out: *out, chart: *chart, quick: *quick,
		profileDir: *profile,
	}
	if cfg.quick {
		cfg.rounds, cfg.seconds, cfg.minMessages = 1, 1, 300
	}
	for name := range strings.SplitSeq(*setups, ",") {
		i := slices.IndexFunc(allSetups, func(s setup) bool { return s.Name == strings.TrimSpace(name) })
		if i < 0 {
			return cfg, svc, fmt.Errorf("-setups: unknown setup %q (want postgres, mysql or sqlite)", name)
		}
		cfg.setups = append(cfg.setups, allSetups[i])
	}
	for s := range strings.SplitSeq(*conc, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return cfg, svc, fmt.Errorf("-concurrency: %q is not a positive integer", s)
		}
		cfg.concurrency = append(cfg.concurrency, n)
	}
	for v := range strings.SplitSeq(*variants, ",") {
		v = strings.TrimSpace(v)
		if !slices.Contains(allVariants, v) {
			return cfg, svc, fmt.Errorf("-variants: unknown variant %q (want %s)", v, strings.Join(allVariants, ", "))
		}
		cfg.variants = append(cfg.variants, v)
	}
	switch {
	case cfg.rounds < 1:
		return cfg, svc, errors.New("-rounds: want at least 1")
	case cfg.seconds <= 0:
		return cfg, svc, errors.New("-seconds: want more than 0")
	case cfg.warmup < 0 || cfg.warmup >= 0.9:
		return cfg, svc, errors.New("-warmup: want a fraction in [0, 0.9)")
	case cfg.payloadSize < 1:
		return cfg, svc, errors.New("-payload: want at least 1 byte")
	}
	return cfg, svc, nil
}

// suite runs the end-to-end matrix.
type suite struct {
	cfg     suiteConfig
	svc     services
	pgURL   string // the bench schema
	myURL   string // the bench database
	payload []byte
	logger  *slog.Logger
	log     io.Writer
	// est is the rate measured so far per cell, which sizes the cell's next run.
	est map[string]float64
}

func runSuite(ctx context.Context, args []string) error {
	cfg, svc, err := parseSuiteFlags(args)
	if err != nil {
		return err
	}
	s := &suite{
		cfg: cfg, svc: svc, payload: newPayload(cfg.payloadSize), log: os.Stderr, est: map[string]float64{},
		logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	if s.svc.dir == "" {
		dir, err := os.MkdirTemp("", "onceflow-bench-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		s.svc.dir = dir
	}
	res := Results{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: describeMachine(),
		Config: map[string]any{
			"rounds": cfg.rounds, "seconds_per_cell": cfg.seconds, "warmup_fraction": cfg.warmup,
			"payload_bytes": cfg.payloadSize, "prefetch": cmp.Or(cfg.prefetch, 10), "max_idle_conns": cfg.maxIdle, "quick": cfg.quick,
		},
	}
	res.Versions = versions(ctx, svc, cfg.setups)
	for _, st := range cfg.setups {
		switch st.Database {
		case "postgres":
			if s.pgURL, err = preparePostgres(ctx, svc.postgres, benchSchema); err != nil {
				return fmt.Errorf("prepare PostgreSQL: %w", err)
			}
		case "mysql":
			if s.myURL, err = prepareMySQL(ctx, svc.mysql, benchDatabase); err != nil {
				return fmt.Errorf("prepare MariaDB: %w", err)
			}
		}
	}

	cells := 0
	for _, st := range cfg.setups {
		cells += len(cfg.concurrency) * len(variantsOf(st, cfg.variants))
	}
	fmt.Fprintf(s.log, "onceflow-bench: %d cells x %d rounds, ~%.0f s of steady state each; load average %.2f on %d cores\n",
		cells, cfg.rounds, cfg.seconds, res.Machine.LoadBefore, res.Machine.Cores)
	started := time.Now()
	for round := 1; round <= cfg.rounds; round++ {
		for _, st := range cfg.setups {
			for _, c := range cfg.concurrency {
				vs := variantsOf(st, cfg.variants)
				// Rotate the order each round, so that a slow spell of the shared machine does
				// not always hit the same variant.
				k := (round - 1) % len(vs)
				vs = append(vs[k:], vs[:k]...)
				for _, v := range vs {
					if err := ctx.Err(); err != nil {
						return err
					}
					e := s.runCell(ctx, st, v, c, round)
					res.Entries = append(res.Entries, e)
					status := fmt.Sprintf("%8.0f msgs/s", e.MsgsPerS)
					if e.Error != "" {
						status = "FAILED: " + e.Error
					}
					fmt.Fprintf(s.log, "[%4.0fs] round %d %-9s c=%-3d %-15s %7d msgs  %s  cpu %s\n",
						time.Since(started).Seconds(), round, st.Name, c, v, e.Messages, status, formatCPU(e.CPU))
				}
			}
		}
	}
	res.Machine.LoadAfter = loadAverage()
	res.Medians = medians(res.Entries)
	res.Targets = evaluateTargets(cfg.setups, cfg.concurrency, res.Medians)

	printReport(os.Stdout, cfg.setups, cfg.concurrency, res)
	if err := writeJSON(cfg.out, res); err != nil {
		return err
	}
	fmt.Fprintf(s.log, "wrote %s\n", cfg.out)
	if cfg.chart != "" {
		if err := writeChart(cfg.chart, cfg.setups, cfg.concurrency, res); err != nil {
			return fmt.Errorf("chart: %w", err)
		}
		fmt.Fprintf(s.log, "wrote %s\n", cfg.chart)
	}
	return nil
}

// runCell measures one variant of one setup at one concurrency.
func (s *suite) runCell(ctx context.Context, st setup, v string, c, round int) Entry {
	e := Entry{
		Name: fmt.Sprintf("%s/%s/c%d", st.Name, v, c), Broker: st.Broker, Database: st.Database,
		Mode: v, Concurrency: c, Round: round,
	}
	if v == vDBLimit || v == vDBLimitGo {
		e.Broker = "none"
	}
	var err error
	switch v {
	case vDBLimit, vDBLimitGo:
		err = s.runDBLimit(ctx, st, v, c, &e)
	default:
		err = s.runE2E(ctx, st, v, c, &e)
	}
	if err != nil {
		e.Error = err.Error()
		e.MsgsPerS = 0
	} else {
		s.est[e.Name] = e.MsgsPerS
	}
	return e
}

// messagesFor sizes a cell: enough messages for the configured seconds of steady state at the
// rate measured so far, or at a guess in the first round.
func (s *suite) messagesFor(st setup, v string, c int) int {
	rate, ok := s.est[fmt.Sprintf("%s/%s/c%d", st.Name, v, c)]
	if !ok {
		rate = guessRate(st, v, c)
	}
	n := int(rate * s.cfg.seconds / (1 - s.cfg.warmup))
	return min(max(n, s.cfg.minMessages), s.cfg.maxMessages)
}

func guessRate(st setup, v string, c int) float64 {
	if st.Database == "sqlite" {
		return 800
	}
	base := 700.0
	if c > 1 {
		base = 1500
	}
	if v == vGroupCommit && c > 1 {
		base *= 2
	}
	return base
}

// Entry is one measured cell: one variant, on one broker and database, at one concurrency, in
// one round.
type Entry struct {
	Name        string  `json:"name"`
	Broker      string  `json:"broker"`
	Database    string  `json:"database"`
	Mode        string  `json:"mode"`
	Concurrency int     `json:"concurrency"`
	Messages    int     `json:"messages"`
	MsgsPerS    float64 `json:"msgs_per_s"`
	Round       int     `json:"round,omitempty"`
	// Seconds is the measured time: from the warm-up mark to the last commit.
	Seconds float64 `json:"seconds,omitempty"`
	// Tool says how the database's own rate was measured (pgbench, go-loop).
	Tool string `json:"tool,omitempty"`
	// CPU is the CPU used during the measured time, in cores: by the whole machine and by each
	// process group (consumer = this process).
	CPU map[string]float64 `json:"cpu,omitempty"`
	// CPUPerMsg is the CPU time per message, in microseconds, of each process group: less
	// sensitive to the load others put on a shared machine than the rate.
	CPUPerMsg map[string]float64 `json:"cpu_us_per_msg,omitempty"`
	// ConnsClosedIdle is how many database connections the consumer's pool closed because more
	// than MaxIdleConns were idle (each is opened again for a later transaction).
	ConnsClosedIdle int64 `json:"conns_closed_idle,omitempty"`
	// WALSyncsPerMsg is PostgreSQL's WAL syncs per message during the measured time (the whole
	// server counts, so other clients add to it).
	WALSyncsPerMsg float64 `json:"wal_syncs_per_msg,omitempty"`
	// WALFPIPerMsg and WALBytesPerMsg are PostgreSQL's full-page images and WAL bytes per
	// message, server-wide like WALSyncsPerMsg.
	WALFPIPerMsg   float64 `json:"wal_fpi_per_msg,omitempty"`
	WALBytesPerMsg float64 `json:"wal_bytes_per_msg,omitempty"`
	Error          string  `json:"error,omitempty"`
}

// Results is what bench/results/latest.json holds.
type Results struct {
	Date     string            `json:"date"`
	Machine  Machine           `json:"machine"`
	Versions map[string]string `json:"versions"`
	Config   map[string]any    `json:"config"`
	// Entries has one entry per cell and round.
	Entries []Entry `json:"entries"`
	// Medians has one entry per cell: the median rate of its rounds.
	Medians []Entry  `json:"medians"`
	Targets []Target `json:"targets"`
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func formatCPU(m map[string]float64) string {
	if m == nil {
		return "-"
	}
	var parts []string
	for _, k := range []string{"machine", "consumer", "postgres", "rabbitmq", "mariadb", "pgbench", "other"} {
		if v, ok := m[k]; ok && (v >= 0.01 || k == "machine") {
			parts = append(parts, fmt.Sprintf("%s=%.2f", k, v))
		}
	}
	return strings.Join(parts, " ")
}
