package main

import (
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

	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// setup is one broker and database pair of the suite.
type setup struct {
	Name     string // postgres, mysql, nats, redis, sqlite
	Broker   string // amqp, nats, redis or sqlite
	Database string // postgres, mysql or sqlite
	Title    string
}

var allSetups = []setup{
	{Name: "postgres", Broker: "amqp", Database: "postgres", Title: "RabbitMQ -> PostgreSQL"},
	{Name: "mysql", Broker: "amqp", Database: "mysql", Title: "RabbitMQ -> MariaDB"},
	{Name: "nats", Broker: "nats", Database: "postgres", Title: "NATS JetStream -> PostgreSQL"},
	{Name: "redis", Broker: "redis", Database: "postgres", Title: "Redis Streams -> PostgreSQL"},
	{Name: "sqlite", Broker: "sqlite", Database: "sqlite", Title: "embedded: SQLite queue -> SQLite"},
}

func setupNames() []string {
	var out []string
	for _, s := range allSetups {
		out = append(out, s.Name)
	}
	return out
}

// The variants of a cell: onceflow's modes, the two hand-written baselines, and the database's
// own rate for the statements of a per-message ExactlyOnce transaction.
const (
	vDefault     = "default"        // ExactlyOnce as the README shows it: nothing set but Concurrency
	vExactlyOnce = "exactlyonce"    // ExactlyOnce, a transaction per message
	vGroupCommit = "exactlyonce-gc" // ExactlyOnce with group commit, a per-message processor
	vBatch       = "batch-gc"       // ExactlyOnce with Handler.BatchProcessor (group commit)
	vExpert      = "expert"         // the hand-written batch consumer on the broker's own client
	vBaseline    = "watermill"      // the hand-written watermill consumer
	vDBLimit     = "db-limit"       // pgbench on PostgreSQL, a Go loop elsewhere
	vDBLimitGo   = "db-limit-go"    // a Go loop on PostgreSQL, beside pgbench
	vAtLeastOnce = "atleastonce"    // AtLeastOnce, a transaction per message
)

var allVariants = []string{vDefault, vExactlyOnce, vGroupCommit, vBatch, vExpert, vBaseline, vDBLimit, vDBLimitGo, vAtLeastOnce}

var defaultVariants = []string{vDefault, vExactlyOnce, vGroupCommit, vBatch, vExpert, vBaseline, vDBLimit}

// onceflowVariants are the variants that run onceflow's Router.
var onceflowVariants = []string{vDefault, vExactlyOnce, vGroupCommit, vBatch, vAtLeastOnce}

// consumerVariants are the variants that consume a topic: onceflow's and the two baselines.
var consumerVariants = append(slices.Clone(onceflowVariants), vExpert, vBaseline)

// The variants the defaults are decided between, beside the expert where it applies.
var (
	decisionVariants = []string{vDefault, vExactlyOnce, vGroupCommit, vBatch}
	steadyVariants   = append(slices.Clone(decisionVariants), vExpert)
)

// The scenarios.
const (
	// scenarioDrain drains a backlog published ahead: the rate from the commit that ends the
	// warm-up to the last commit.
	scenarioDrain = "drain"
	// scenarioSmall is the drain with small payloads (-small-payload): what the consumer costs
	// per message when the payload costs little.
	scenarioSmall = "small"
	// scenarioSteady offers a fixed rate for some seconds: the latency from publish to commit.
	scenarioSteady = "steady"
	// scenarioSlow drains a backlog with a processor that waits (a remote call) before it
	// writes: whether group commit can be the default.
	scenarioSlow = "slow"
	// scenarioReruns drains a backlog in which 1 message in -fail-every fails once, after its
	// write: how often a processor runs again for a delivery because another message of its
	// group failed.
	scenarioReruns = "reruns"
)

var allScenarios = []string{scenarioDrain, scenarioSmall, scenarioSteady, scenarioSlow, scenarioReruns}

// cell is one measurement: a variant of a setup at a concurrency in a scenario.
type cell struct {
	st       setup
	variant  string
	c        int
	scenario string
	// payload is the size of each message's payload in bytes.
	payload int
	// rate is the offered rate of the steady state, in msgs/s.
	rate float64
	// prefetch is the window of deliveries of each subscription, for onceflow and the
	// watermill baseline (the expert's is expertPrefetch); 0 leaves it to the broker's
	// default, as the default variant does.
	prefetch int
	// sweep marks a group-commit cell of the prefetch sweep: its prefetch is not the run's.
	sweep bool
}

func (cl cell) name() string {
	switch {
	case cl.scenario == scenarioSteady:
		return fmt.Sprintf("%s/%s@%g/%s/c%d", cl.st.Name, cl.scenario, cl.rate, cl.variant, cl.c)
	case cl.scenario != scenarioDrain:
		return fmt.Sprintf("%s/%s/%s/c%d", cl.st.Name, cl.scenario, cl.variant, cl.c)
	case cl.sweep:
		return fmt.Sprintf("%s/%s-p%d/c%d", cl.st.Name, cl.variant, cl.prefetch, cl.c)
	}
	return fmt.Sprintf("%s/%s/c%d", cl.st.Name, cl.variant, cl.c)
}

// newCell returns the cell of variant v: the default variant leaves the prefetch to the broker.
func newCell(st setup, v string, c int, scenario string, payload, prefetch int) cell {
	if v == vDefault {
		prefetch = 0
	}
	return cell{st: st, variant: v, c: c, scenario: scenario, payload: payload, prefetch: prefetch}
}

// suiteConfig is what `onceflow-bench run` measures.
type suiteConfig struct {
	setups      []setup
	concurrency []int
	variants    []string
	scenarios   []string
	rounds      int
	seconds     float64 // of a drain, aimed at per cell
	warmup      float64 // fraction of a drain's messages not measured
	minMessages int
	maxMessages int
	payloadSize int
	prefetch    int   // per subscription, for the tuned variants of onceflow and the watermill baseline
	sweep       []int // further prefetches for group commit
	sweepConc   []int // the concurrencies of the sweep
	maxIdle     int

	smallPayload  int // bytes per message of the small scenario
	smallVariants []string

	rates          []float64 // offered in the steady state, msgs/s
	steadySeconds  float64
	steadyWarmup   float64
	steadyConc     []int
	steadySetups   []string
	steadyVariants []string

	slowWait     time.Duration
	slowConc     int
	slowSetups   []string
	slowVariants []string

	failEvery     int // 1 message in failEvery fails once in the reruns scenario
	rerunMessages int // fewest messages of a reruns drain
	rerunConc     int
	rerunSetups   []string
	rerunVariants []string

	out, chart string
	profileDir string
	quick      bool
	list       bool
}

func parseList[T any](flagName, s string, parse func(string) (T, error)) ([]T, error) {
	var out []T
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	for part := range strings.SplitSeq(s, ",") {
		v, err := parse(strings.TrimSpace(part))
		if err != nil {
			return nil, fmt.Errorf("-%s: %w", flagName, err)
		}
		out = append(out, v)
	}
	return out, nil
}

func positiveFloat(s string) (float64, error) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f <= 0 {
		return 0, fmt.Errorf("%q is not a positive number", s)
	}
	return f, nil
}

func positiveInt(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("%q is not a positive integer", s)
	}
	return n, nil
}

func oneOf(allowed []string) func(string) (string, error) {
	return func(s string) (string, error) {
		if !slices.Contains(allowed, s) {
			return "", fmt.Errorf("unknown value %q (want %s)", s, strings.Join(allowed, ", "))
		}
		return s, nil
	}
}

// A quick run writes its results and chart here, so that a smoke run never replaces the
// recorded run's.
const (
	quickOut   = "bin/bench-quick.json"
	quickChart = "bin/bench-quick.svg"
)

func parseSuiteFlags(args []string) (suiteConfig, services, error) {
	svc := defaultServices()
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	setups := fs.String("setups", strings.Join(setupNames(), ","), "broker -> database pairs: postgres (RabbitMQ -> PostgreSQL), mysql (RabbitMQ -> MariaDB), nats (NATS JetStream -> PostgreSQL), redis (Redis Streams -> PostgreSQL), sqlite (SQLite queue -> SQLite)")
	conc := fs.String("concurrency", "1,4,16", "concurrencies of the drain and the small-payload drain: handler Concurrency, watermill subscriptions, expert workers")
	variants := fs.String("variants", strings.Join(defaultVariants, ","), "variants of the drain ("+strings.Join(allVariants, ", ")+")")
	scenarios := fs.String("scenarios", strings.Join(allScenarios, ","), "scenarios: drain (a backlog), small (a backlog of small payloads), steady (a fixed rate, latency), slow (a backlog, a processor that waits), reruns (a backlog, some messages fail once)")
	rounds := fs.Int("rounds", 3, "rounds; each cell is measured once per round, interleaved, and the median reported")
	seconds := fs.Float64("seconds", 1, "seconds of a drain aimed at per cell (the message count follows from the rate measured so far)")
	warmup := fs.Float64("warmup", 0.15, "fraction of each drain's messages committed before the clock starts")
	minMsgs := fs.Int("min-messages", 1500, "fewest messages per drain")
	maxMsgs := fs.Int("max-messages", 150000, "most messages per drain")
	payload := fs.Int("payload", 1024, "payload bytes per message, in every scenario but small")
	smallPayload := fs.Int("small-payload", 100, "payload bytes per message of the small scenario")
	smallVars := fs.String("small-variants", strings.Join([]string{vBatch, vExpert}, ","), "variants of the small scenario")
	prefetch := fs.Int("prefetch", expertPrefetch, "deliveries each subscription holds (broker.Options.Prefetch), for onceflow's tuned variants and the watermill baseline (the default variant keeps the broker's default)")
	sweep := fs.String("gc-prefetch", "", "further prefetches for group commit in the drain, on the first setup of each broker (empty: none)")
	sweepConc := fs.String("gc-prefetch-concurrency", "1,16", "concurrencies of the drain at which group commit is measured at the further prefetches")
	maxIdle := fs.Int("max-idle", 0, "database/sql MaxIdleConns of the consumer's pool (0: as sqldb.Open leaves it)")
	rate := fs.String("rate", "100,1000", "offered rates of the steady state, msgs/s")
	steadySecs := fs.Float64("steady-seconds", 3, "measured seconds of the steady state, after its warm-up")
	steadyWarm := fs.Float64("steady-warmup", 1, "seconds of the steady state before the clock starts")
	steadyConc := fs.String("steady-concurrency", "16", "concurrencies of the steady state")
	steadySetups := fs.String("steady-setups", "postgres,nats", "setups of the steady state")
	steadyVars := fs.String("steady-variants", strings.Join(steadyVariants, ","), "variants of the steady state ("+strings.Join(consumerVariants, ", ")+")")
	slowWait := fs.Duration("slow-wait", 5*time.Millisecond, "the slow processor's wait per call: per message, or per batch for the batch processor")
	slowConc := fs.Int("slow-concurrency", 16, "concurrency of the slow scenario")
	slowSetups := fs.String("slow-setups", "postgres,nats", "setups of the slow scenario")
	slowVars := fs.String("slow-variants", strings.Join(decisionVariants, ","), "variants of the slow scenario ("+strings.Join(onceflowVariants, ", ")+")")
	failEvery := fs.Int("fail-every", 1000, "in the reruns scenario, 1 message in this many fails once, after its write")
	rerunMsgs := fs.Int("rerun-messages", 10000, "fewest messages of a reruns drain")
	rerunConc := fs.Int("rerun-concurrency", 16, "concurrency of the reruns scenario")
	rerunSetups := fs.String("rerun-setups", "postgres,nats", "setups of the reruns scenario")
	rerunVars := fs.String("rerun-variants", strings.Join(decisionVariants, ","), "variants of the reruns scenario ("+strings.Join(onceflowVariants, ", ")+")")
	quick := fs.Bool("quick", os.Getenv("BENCH_QUICK") == "1", "a short smoke run: 1 round, short cells, few messages (also BENCH_QUICK=1)")
	list := fs.Bool("list", false, "print the cells of one round, by scenario, and exit without measuring")
	out := fs.String("out", "bench/results/latest.json", "results file (a quick run's: "+quickOut+")")
	chart := fs.String("chart", "docs/performance.svg", "chart file (.svg or .png); empty for none (a quick run's: "+quickChart+")")
	profile := fs.String("cpuprofile-dir", "", "write a CPU profile of the consumer, and allocation profiles at the start and end of its window, for each cell at the highest concurrency into this directory (profiling slows what it measures: not for the reported numbers)")
	fs.StringVar(&svc.postgres, "postgres", svc.postgres, "PostgreSQL URL")
	fs.StringVar(&svc.mysql, "mysql", svc.mysql, "MariaDB/MySQL URL")
	fs.StringVar(&svc.amqp, "amqp", svc.amqp, "RabbitMQ URL")
	fs.StringVar(&svc.nats, "nats", svc.nats, "NATS URL")
	fs.StringVar(&svc.redis, "redis", svc.redis, "Redis URL")
	fs.StringVar(&svc.dir, "dir", "", "directory for SQLite files (default: a temporary directory, removed at the end)")
	if err := fs.Parse(args); err != nil {
		return suiteConfig{}, svc, err
	}
	cfg := suiteConfig{
		rounds: *rounds, seconds: *seconds, warmup: *warmup, minMessages: *minMsgs, maxMessages: *maxMsgs,
		payloadSize: *payload, smallPayload: *smallPayload, prefetch: *prefetch, maxIdle: *maxIdle, out: *out, chart: *chart, quick: *quick,
		profileDir: *profile, steadySeconds: *steadySecs, steadyWarmup: *steadyWarm,
		slowWait: *slowWait, slowConc: *slowConc, failEvery: *failEvery, rerunMessages: *rerunMsgs, rerunConc: *rerunConc,
		list: *list,
	}
	if cfg.quick {
		// Short cells, unless a flag says otherwise, and files apart from the recorded run's.
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for name, apply := range map[string]func(){
			"rounds":         func() { cfg.rounds = 1 },
			"seconds":        func() { cfg.seconds = 0.5 },
			"min-messages":   func() { cfg.minMessages = 300 },
			"max-messages":   func() { cfg.maxMessages = 20000 },
			"steady-seconds": func() { cfg.steadySeconds = 1 },
			"steady-warmup":  func() { cfg.steadyWarmup = 0.5 },
			"rerun-messages": func() { cfg.rerunMessages = 2000 },
			"out":            func() { cfg.out = quickOut },
			"chart":          func() { cfg.chart = quickChart },
		} {
			if !set[name] {
				apply()
			}
		}
	}
	var err error
	names, err := parseList("setups", *setups, oneOf(setupNames()))
	if err != nil {
		return cfg, svc, err
	}
	for _, n := range names {
		cfg.setups = append(cfg.setups, allSetups[slices.IndexFunc(allSetups, func(s setup) bool { return s.Name == n })])
	}
	if cfg.concurrency, err = parseList("concurrency", *conc, positiveInt); err != nil {
		return cfg, svc, err
	}
	if cfg.variants, err = parseList("variants", *variants, oneOf(allVariants)); err != nil {
		return cfg, svc, err
	}
	if cfg.scenarios, err = parseList("scenarios", *scenarios, oneOf(allScenarios)); err != nil {
		return cfg, svc, err
	}
	if cfg.sweep, err = parseList("gc-prefetch", *sweep, positiveInt); err != nil {
		return cfg, svc, err
	}
	if cfg.sweepConc, err = parseList("gc-prefetch-concurrency", *sweepConc, positiveInt); err != nil {
		return cfg, svc, err
	}
	if cfg.smallVariants, err = parseList("small-variants", *smallVars, oneOf(consumerVariants)); err != nil {
		return cfg, svc, err
	}
	if cfg.rates, err = parseList("rate", *rate, positiveFloat); err != nil {
		return cfg, svc, err
	}
	if cfg.steadyConc, err = parseList("steady-concurrency", *steadyConc, positiveInt); err != nil {
		return cfg, svc, err
	}
	if cfg.steadySetups, err = parseList("steady-setups", *steadySetups, oneOf(setupNames())); err != nil {
		return cfg, svc, err
	}
	if cfg.steadyVariants, err = parseList("steady-variants", *steadyVars, oneOf(consumerVariants)); err != nil {
		return cfg, svc, err
	}
	if cfg.slowSetups, err = parseList("slow-setups", *slowSetups, oneOf(setupNames())); err != nil {
		return cfg, svc, err
	}
	// The wait and the failures are the processor's: onceflow's variants only.
	if cfg.slowVariants, err = parseList("slow-variants", *slowVars, oneOf(onceflowVariants)); err != nil {
		return cfg, svc, err
	}
	if cfg.rerunSetups, err = parseList("rerun-setups", *rerunSetups, oneOf(setupNames())); err != nil {
		return cfg, svc, err
	}
	if cfg.rerunVariants, err = parseList("rerun-variants", *rerunVars, oneOf(onceflowVariants)); err != nil {
		return cfg, svc, err
	}
	switch {
	case len(cfg.setups) == 0 || len(cfg.concurrency) == 0:
		return cfg, svc, errors.New("-setups and -concurrency: want at least one")
	case cfg.rounds < 1:
		return cfg, svc, errors.New("-rounds: want at least 1")
	case cfg.seconds <= 0 || cfg.steadySeconds <= 0:
		return cfg, svc, errors.New("-seconds, -steady-seconds: want more than 0")
	case cfg.warmup < 0 || cfg.warmup >= 0.9:
		return cfg, svc, errors.New("-warmup: want a fraction in [0, 0.9)")
	case cfg.payloadSize < 1 || cfg.smallPayload < 1:
		return cfg, svc, errors.New("-payload, -small-payload: want at least 1 byte")
	case cfg.prefetch < 1:
		return cfg, svc, errors.New("-prefetch: want at least 1")
	case slices.Contains(cfg.scenarios, scenarioSteady) && len(cfg.rates) == 0:
		return cfg, svc, errors.New("-rate: want at least one rate for the steady state")
	case cfg.slowConc < 1 || cfg.slowWait < 0:
		return cfg, svc, errors.New("-slow-concurrency: want at least 1; -slow-wait: not negative")
	case cfg.failEvery < 1 || cfg.rerunConc < 1 || cfg.rerunMessages < 1:
		return cfg, svc, errors.New("-fail-every, -rerun-concurrency, -rerun-messages: want at least 1")
	}
	return cfg, svc, nil
}

// groups returns the cells of one round, in groups whose variants are measured one after the
// other: per setup, the drain at each concurrency (with the prefetch sweep), the small-payload
// drain at each concurrency, the steady state at each rate, the slow processor, the reruns.
func (cfg suiteConfig) groups() [][]cell {
	var groups [][]cell
	sweptBrokers := map[string]bool{}
	dbLimited := map[string]bool{}
	has := func(scenario string) bool { return slices.Contains(cfg.scenarios, scenario) }
	for _, st := range cfg.setups {
		sweep := len(cfg.sweep) > 0 && !sweptBrokers[st.Broker] && slices.Contains(cfg.variants, vGroupCommit)
		sweptBrokers[st.Broker] = true
		// The database's own rate does not depend on the broker: once per database.
		dbLimit := !dbLimited[st.Database]
		dbLimited[st.Database] = true
		if has(scenarioDrain) {
			for _, c := range cfg.concurrency {
				var g []cell
				for _, v := range cfg.variants {
					if (v == vDBLimit || v == vDBLimitGo) && !dbLimit || v == vDBLimitGo && st.Database != "postgres" {
						continue
					}
					g = append(g, newCell(st, v, c, scenarioDrain, cfg.payloadSize, cfg.prefetch))
				}
				if sweep && slices.Contains(cfg.sweepConc, c) {
					for _, p := range cfg.sweep {
						if p != cfg.prefetch {
							cl := newCell(st, vGroupCommit, c, scenarioDrain, cfg.payloadSize, p)
							cl.sweep = true
							g = append(g, cl)
						}
					}
				}
				groups = append(groups, g)
			}
		}
		if has(scenarioSmall) {
			for _, c := range cfg.concurrency {
				var g []cell
				for _, v := range cfg.smallVariants {
					g = append(g, newCell(st, v, c, scenarioSmall, cfg.smallPayload, cfg.prefetch))
				}
				groups = append(groups, g)
			}
		}
		if has(scenarioSteady) && slices.Contains(cfg.steadySetups, st.Name) {
			for _, rate := range cfg.rates {
				for _, c := range cfg.steadyConc {
					var g []cell
					for _, v := range cfg.steadyVariants {
						cl := newCell(st, v, c, scenarioSteady, cfg.payloadSize, cfg.prefetch)
						cl.rate = rate
						g = append(g, cl)
					}
					groups = append(groups, g)
				}
			}
		}
		for _, sc := range []struct {
			scenario string
			setups   []string
			variants []string
			c        int
		}{
			{scenarioSlow, cfg.slowSetups, cfg.slowVariants, cfg.slowConc},
			{scenarioReruns, cfg.rerunSetups, cfg.rerunVariants, cfg.rerunConc},
		} {
			if has(sc.scenario) && slices.Contains(sc.setups, st.Name) {
				var g []cell
				for _, v := range sc.variants {
					g = append(g, newCell(st, v, sc.c, sc.scenario, cfg.payloadSize, cfg.prefetch))
				}
				groups = append(groups, g)
			}
		}
	}
	return groups
}

// suite runs the end-to-end matrix.
type suite struct {
	cfg      suiteConfig
	svc      services
	pgURL    string         // the bench schema
	myURL    string         // the bench database
	payloads map[int][]byte // by size
	logger   *slog.Logger
	log      io.Writer
	// est is the rate measured so far per cell, which sizes the cell's next run; grouped says
	// whether the cell committed its messages in groups.
	est     map[string]float64
	grouped map[string]bool
}

func runSuite(ctx context.Context, args []string) error {
	cfg, svc, err := parseSuiteFlags(args)
	if err != nil {
		return err
	}
	if cfg.list {
		return listCells(os.Stdout, cfg)
	}
	s := &suite{
		cfg: cfg, svc: svc, log: os.Stderr, est: map[string]float64{}, grouped: map[string]bool{},
		payloads: map[int][]byte{cfg.payloadSize: newPayload(cfg.payloadSize), cfg.smallPayload: newPayload(cfg.smallPayload)},
		logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
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
			"payload_bytes": cfg.payloadSize, "prefetch": cfg.prefetch, "gc_prefetch_sweep": cfg.sweep, "gc_prefetch_concurrency": cfg.sweepConc,
			"max_idle_conns": cfg.maxIdle, "quick": cfg.quick, "scenarios": cfg.scenarios,
			"expert": map[string]any{"prefetch": expertPrefetch, "batch": expertBatch, "wait_ms": expertWait.Seconds() * 1000},
			"small":  map[string]any{"payload_bytes": cfg.smallPayload, "variants": cfg.smallVariants},
			"steady": map[string]any{"rates": cfg.rates, "seconds": cfg.steadySeconds, "warmup_seconds": cfg.steadyWarmup, "concurrency": cfg.steadyConc, "setups": cfg.steadySetups},
			"slow":   map[string]any{"wait_ms": cfg.slowWait.Seconds() * 1000, "concurrency": cfg.slowConc, "setups": cfg.slowSetups},
			"reruns": map[string]any{"fail_every": cfg.failEvery, "min_messages": cfg.rerunMessages, "concurrency": cfg.rerunConc, "setups": cfg.rerunSetups},
		},
	}
	res.Versions = versions(ctx, svc, cfg.setups)
	for _, st := range cfg.setups {
		switch {
		case st.Database == "postgres" && s.pgURL == "":
			if s.pgURL, err = preparePostgres(ctx, svc.postgres, benchSchema); err != nil {
				return fmt.Errorf("prepare PostgreSQL: %w", err)
			}
			defer dropSchema(svc.postgres, benchSchema)
		case st.Database == "mysql" && s.myURL == "":
			if s.myURL, err = prepareMySQL(ctx, svc.mysql, benchDatabase); err != nil {
				return fmt.Errorf("prepare MariaDB: %w", err)
			}
			defer dropDatabase(svc.mysql, benchDatabase)
		}
	}

	groups := cfg.groups()
	cells := 0
	for _, g := range groups {
		cells += len(g)
	}
	fmt.Fprintf(s.log, "onceflow-bench: %d cells x %d rounds (drain ~%.1f s each, steady %g+%g s at %v msgs/s); load average %.2f on %d cores\n",
		cells, cfg.rounds, cfg.seconds, cfg.steadyWarmup, cfg.steadySeconds, cfg.rates, res.Machine.LoadBefore, res.Machine.Cores)
	started := time.Now()
	for round := 1; round <= cfg.rounds; round++ {
		for _, g := range groups {
			// Rotate the order each round, so that a slow spell of the shared machine does
			// not always hit the same variant.
			k := (round - 1) % len(g)
			for _, cl := range append(slices.Clone(g[k:]), g[:k]...) {
				if err := ctx.Err(); err != nil {
					return err
				}
				e := s.runCell(ctx, cl, round)
				res.Entries = append(res.Entries, e)
				fmt.Fprintf(s.log, "[%4.0fs] round %d %-40s %s  cpu %s\n", time.Since(started).Seconds(), round, e.Name, e.status(), formatCPU(e.CPU))
			}
		}
	}
	res.Machine.LoadAfter = loadAverage()
	res.Medians = medians(res.Entries)
	res.Targets = evaluateTargets(cfg, res.Medians)

	printReport(os.Stdout, cfg, res)
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

// listCells prints the cells of one round, by scenario, with their count.
func listCells(w io.Writer, cfg suiteConfig) error {
	byScenario := map[string][]string{}
	total := 0
	for _, g := range cfg.groups() {
		for _, cl := range g {
			byScenario[cl.scenario] = append(byScenario[cl.scenario], cl.name())
			total++
		}
	}
	for _, sc := range allScenarios {
		if names := byScenario[sc]; len(names) > 0 {
			fmt.Fprintf(w, "%s (%d cells):\n  %s\n", sc, len(names), strings.Join(names, "\n  "))
		}
	}
	fmt.Fprintf(w, "%d cells per round, %d rounds\n", total, cfg.rounds)
	return nil
}

// runCell measures one cell.
func (s *suite) runCell(ctx context.Context, cl cell, round int) Entry {
	e := Entry{
		Name: cl.name(), Broker: cl.st.Broker, Database: cl.st.Database, Mode: cl.variant,
		Concurrency: cl.c, Round: round, Scenario: cl.scenario, PayloadBytes: cl.payload,
	}
	switch {
	case cl.variant == vDBLimit || cl.variant == vDBLimitGo:
		e.Broker = "none"
	case cl.variant == vExpert:
		e.Prefetch, e.BrokerPrefetch = expertPrefetch, groupPending(cl.st, expertPrefetch, cl.c)
	case cl.variant == vBaseline && cl.st.Broker == "sqlite":
		e.Prefetch, e.BrokerPrefetch = sqlitequeue.DefaultBatchSize, sqlitequeue.DefaultBatchSize
	case cl.variant == vBaseline:
		e.Prefetch, e.BrokerPrefetch = cl.prefetch, groupPending(cl.st, cl.prefetch, cl.c)
	default:
		e.Prefetch, e.BrokerPrefetch = cl.prefetch, cl.prefetch
	}
	if cl.scenario == scenarioSlow {
		e.WaitMs = s.cfg.slowWait.Seconds() * 1000
	}
	var err error
	switch cl.variant {
	case vDBLimit, vDBLimitGo:
		err = s.runDBLimit(ctx, cl, &e)
	default:
		err = s.runE2E(ctx, cl, &e)
	}
	if err != nil {
		e.Error = err.Error()
		e.MsgsPerS = 0
	} else {
		s.est[e.Name] = e.MsgsPerS
		s.grouped[e.Name] = e.CommitsPerMsg > 0 && e.CommitsPerMsg < 0.5
	}
	return e
}

// messagesFor sizes a drain: enough messages for the configured seconds at the rate measured
// so far, or at a guess in the first round.
func (s *suite) messagesFor(cl cell) int {
	rate, ok := s.est[cl.name()]
	if !ok {
		rate = guessRate(cl)
	}
	n := int(rate * s.cfg.seconds / (1 - s.cfg.warmup))
	// Consumers that commit in batches commit in waves of up to concurrency × 64 messages at
	// once: the drain needs some waves for its first and last commits to bound it well, within
	// three times the aimed seconds (a slow consumer's groups are small anyway). Whether the
	// default variant commits in groups is the library's choice, seen in its previous round.
	if cl.variant == vGroupCommit || cl.variant == vBatch || cl.variant == vExpert || s.grouped[cl.name()] {
		waves := 10
		if s.cfg.quick {
			waves = 2
		}
		n = max(n, min(int(float64(waves*cl.c*expertBatch)/(1-s.cfg.warmup)), 3*n))
	}
	n = min(max(n, s.cfg.minMessages), s.cfg.maxMessages)
	if cl.scenario == scenarioReruns {
		// Enough messages for some to fail.
		n = max(n, s.cfg.rerunMessages)
	}
	return n
}

// guessRate is a cautious guess of a cell's rate on the 2-core reference machine, for its first
// round.
func guessRate(cl cell) float64 {
	switch {
	case cl.scenario == scenarioSteady:
		return 1000
	case cl.variant == vExpert || cl.variant == vBatch:
		if cl.st.Database == "sqlite" {
			return 3000
		}
		return 6000
	case cl.variant == vGroupCommit && cl.scenario == scenarioSlow:
		return 1000
	case cl.variant == vGroupCommit:
		if cl.prefetch <= 10 || cl.c == 1 {
			return 1500
		}
		return 3000
	case cl.scenario == scenarioSlow:
		return float64(cl.c) * 120
	case cl.st.Database == "sqlite":
		return 800
	case cl.c == 1:
		return 700
	}
	return 1500
}

// Entry is one measured cell: one variant, on one broker and database, at one concurrency, in
// one scenario and round.
type Entry struct {
	Name        string `json:"name"`
	Broker      string `json:"broker"`
	Database    string `json:"database"`
	Mode        string `json:"mode"`
	Scenario    string `json:"scenario,omitempty"`
	Concurrency int    `json:"concurrency"`
	// PayloadBytes is the size of each message's payload.
	PayloadBytes int     `json:"payload_bytes,omitempty"`
	Messages     int     `json:"messages"`
	MsgsPerS     float64 `json:"msgs_per_s"`
	Round        int     `json:"round,omitempty"`
	// Prefetch is the window of deliveries of each subscription (worker for the expert), and
	// BrokerPrefetch what the broker was told: broker.Options.Prefetch for onceflow, the
	// consumer's MaxAckPending (the whole group's) for the NATS baseline and expert.
	Prefetch       int `json:"prefetch,omitempty"`
	BrokerPrefetch int `json:"broker_prefetch,omitempty"`
	// Seconds is the measured time: from the commit that ended the warm-up to the last commit
	// of a drain; the publishing after the warm-up in the steady state.
	Seconds float64 `json:"seconds,omitempty"`
	// OfferedRate is the steady state's publish rate; MsgsPerS is then the commit rate.
	OfferedRate float64 `json:"offered_rate,omitempty"`
	// Latency from publish to commit of the messages published after the steady state's
	// warm-up, in milliseconds.
	LatencyP50Ms float64 `json:"latency_p50_ms,omitempty"`
	LatencyP99Ms float64 `json:"latency_p99_ms,omitempty"`
	LatencyMaxMs float64 `json:"latency_max_ms,omitempty"`
	// WaitMs is the slow processor's wait per call.
	WaitMs float64 `json:"processor_wait_ms,omitempty"`
	// Tool says how the database's own rate was measured (pgbench, go-loop).
	Tool string `json:"tool,omitempty"`
	// CPU is the CPU used during the measured time, in cores: by the whole machine and by each
	// process group (consumer = this process).
	CPU map[string]float64 `json:"cpu,omitempty"`
	// CPUPerMsg is the CPU time per message, in microseconds, of each process group: less
	// sensitive to the load others put on a shared machine than the rate.
	CPUPerMsg map[string]float64 `json:"cpu_us_per_msg,omitempty"`
	// PeakRSSMiB is the bench process's peak RSS while the consumer ran, its RSS (after
	// returning free memory to the system) being BaseRSSMiB when the consumer started. The
	// consumer runs in the bench process: the difference is what it took.
	PeakRSSMiB float64 `json:"peak_rss_mib,omitempty"`
	BaseRSSMiB float64 `json:"base_rss_mib,omitempty"`
	// ConnsClosedIdle is how many database connections the consumer's pool closed because more
	// than MaxIdleConns were idle (each is opened again for a later transaction).
	ConnsClosedIdle int64 `json:"conns_closed_idle,omitempty"`
	// WALSyncsPerMsg is the database's log syncs per message: over the whole cell, warm-up
	// included, for a consumer, during the measured time for the database limit. PostgreSQL's
	// WAL syncs and InnoDB's fsyncs (redo log and data files) count for the whole server, so
	// other clients add to them; on SQLite it is the consumer's commits, each of which syncs
	// the file's WAL under synchronous=FULL (checkpoints add a few).
	WALSyncsPerMsg float64 `json:"wal_syncs_per_msg,omitempty"`
	// WALFPIPerMsg and WALBytesPerMsg are PostgreSQL's full-page images and WAL bytes per
	// message (on MariaDB and MySQL the bytes of InnoDB's redo log), server-wide like
	// WALSyncsPerMsg.
	WALFPIPerMsg   float64 `json:"wal_fpi_per_msg,omitempty"`
	WALBytesPerMsg float64 `json:"wal_bytes_per_msg,omitempty"`
	// CommitsPerMsg is the consumer's transactions committed per message, over the whole cell:
	// 1 for a transaction per message, about 1/64 for full groups or batches.
	CommitsPerMsg float64 `json:"commits_per_msg,omitempty"`
	// In the reruns scenario: FailuresInjected is how many messages failed once, after their
	// write; ProcessorCallsPerMsg the processor's runs per message (a batch processor's count
	// once per message it is handed); RerunsPer1000 the runs, per 1,000 messages, beyond the
	// first of messages that did not fail themselves: a group's members run again because
	// another member failed.
	FailuresInjected     int64   `json:"failures_injected,omitempty"`
	ProcessorCallsPerMsg float64 `json:"processor_calls_per_msg,omitempty"`
	RerunsPer1000        float64 `json:"reruns_per_1000_msgs,omitempty"`
	// Failures counts the errors a consumer recovered from (the expert's batches given back).
	Failures int64  `json:"failures,omitempty"`
	Error    string `json:"error,omitempty"`
}

func (e Entry) status() string {
	switch {
	case e.Error != "":
		return "FAILED: " + e.Error
	case e.Scenario == scenarioSteady:
		return fmt.Sprintf("%6.0f msgs/s  p50 %6.1f ms  p99 %6.1f ms", e.MsgsPerS, e.LatencyP50Ms, e.LatencyP99Ms)
	case e.Scenario == scenarioReruns:
		return fmt.Sprintf("%7d msgs %8.0f msgs/s  %d failed once, %.4f calls/msg", e.Messages, e.MsgsPerS, e.FailuresInjected, e.ProcessorCallsPerMsg)
	}
	return fmt.Sprintf("%7d msgs %8.0f msgs/s", e.Messages, e.MsgsPerS)
}

// Results is what bench/results/latest.json holds.
type Results struct {
	Date     string            `json:"date"`
	Machine  Machine           `json:"machine"`
	Versions map[string]string `json:"versions"`
	Config   map[string]any    `json:"config"`
	// Entries has one entry per cell and round.
	Entries []Entry `json:"entries"`
	// Medians has one entry per cell: the round with the median rate (the median p99 latency
	// in the steady state).
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
	for _, k := range cpuGroups {
		if v, ok := m[k]; ok && (v >= 0.01 || k == "machine") {
			parts = append(parts, fmt.Sprintf("%s=%.2f", k, v))
		}
	}
	return strings.Join(parts, " ")
}
