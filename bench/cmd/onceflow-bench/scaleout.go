package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sort"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/sqldb"
)

// ScaleOutResults is what bench/results/scaleout.json holds: the drain rate of 1, 2 and 4
// consumer processes of one handler against one PostgreSQL, per broker.
type ScaleOutResults struct {
	Date     string            `json:"date"`
	Machine  Machine           `json:"machine"`
	Versions map[string]string `json:"versions"`
	Config   map[string]any    `json:"config"`
	Cells    []ScaleOutCell    `json:"cells"`
	Medians  []ScaleOutMedian  `json:"medians"`
}

// ScaleOutCell is one drain.
type ScaleOutCell struct {
	Broker    string  `json:"broker"`
	Processes int     `json:"processes"`
	Round     int     `json:"round"`
	Messages  int     `json:"messages"`
	Seconds   float64 `json:"seconds"`
	MsgsPerS  float64 `json:"msgs_per_s"`
	// MachineCPU is the machine's busy cores during the drain, of its cores in all.
	MachineCPU float64 `json:"machine_cpu"`
}

// ScaleOutMedian is the median rate of a broker at a number of processes, and its ratio to
// one process.
type ScaleOutMedian struct {
	Broker    string  `json:"broker"`
	Processes int     `json:"processes"`
	MsgsPerS  float64 `json:"msgs_per_s"`
	Scaling   float64 `json:"scaling"`
}

// scaleOutWarm is how many messages a Kafka drain applies before its clock starts, while the
// consumer group settles.
const scaleOutWarm = 200

func runScaleOut(ctx context.Context, args []string) error {
	svc := defaultServices()
	fs := flag.NewFlagSet("scaleout", flag.ContinueOnError)
	procsFlag := fs.String("processes", "1,2,4", "numbers of consumer processes")
	brokersFlag := fs.String("brokers", "amqp,kafka", "brokers: amqp (RabbitMQ), kafka (an in-process Kafka protocol cluster, kfake)")
	rounds := fs.Int("rounds", 3, "rounds; each cell is measured once per round, interleaved, and the median reported")
	messages := fs.Int("messages", 20000, "messages per drain")
	conc := fs.Int("concurrency", 2, "handler Concurrency of each process")
	mode := fs.String("mode", vGroupCommit, "exactlyonce or exactlyonce-gc")
	partitions := fs.Int("partitions", 8, "partitions of each Kafka topic: at least processes x concurrency, or members stay idle")
	payloadSize := fs.Int("payload", 1024, "payload bytes per message")
	out := fs.String("out", "bench/results/scaleout.json", "results file")
	fs.StringVar(&svc.postgres, "postgres", svc.postgres, "PostgreSQL URL")
	fs.StringVar(&svc.amqp, "amqp", svc.amqp, "RabbitMQ URL")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if os.Getenv("BENCH_QUICK") == "1" {
		*rounds, *messages = 1, min(*messages, 4000)
	}
	procs, err := parseList("processes", *procsFlag, positiveInt)
	if err != nil {
		return err
	}
	brokers, err := parseList("brokers", *brokersFlag, oneOf([]string{"amqp", "kafka"}))
	if err != nil {
		return err
	}
	if !slices.Contains([]string{vExactlyOnce, vGroupCommit}, *mode) {
		return fmt.Errorf("-mode: %q is not exactlyonce or exactlyonce-gc", *mode)
	}

	res := ScaleOutResults{
		Date: time.Now().UTC().Format(time.RFC3339), Machine: describeMachine(),
		Versions: versions(ctx, svc, []setup{{Database: "postgres", Broker: "amqp"}}),
		Config: map[string]any{"processes": procs, "brokers": brokers, "rounds": *rounds, "messages": *messages,
			"concurrency": *conc, "mode": *mode, "kafka_partitions": *partitions, "payload_bytes": *payloadSize, "database": "postgres"},
	}
	schema := benchSchema + "_scaleout"
	dbURL, err := preparePostgres(ctx, svc.postgres, schema)
	if err != nil {
		return err
	}
	defer dropSchema(svc.postgres, schema)
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return err
	}
	defer db.Close()

	brokerURL := map[string]string{"amqp": svc.amqp}
	var kafkaSeeds []string
	if slices.Contains(brokers, "kafka") {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.DefaultNumPartitions(*partitions))
		if err != nil {
			return fmt.Errorf("start an in-process Kafka cluster: %w", err)
		}
		defer cluster.Close()
		kafkaSeeds = cluster.ListenAddrs()
		brokerURL["kafka"] = kafkatest.URLOf(kafkaSeeds, fmt.Sprintf("partitions=%d", *partitions))
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d := scaleOutDrain{exe: exe, kafkaSeeds: kafkaSeeds, db: db, dbURL: dbURL, messages: *messages, conc: *conc, mode: *mode, payload: newPayload(*payloadSize)}

	fmt.Fprintf(os.Stderr, "onceflow-bench scaleout: %s at concurrency %d per process, %d messages per drain, %d rounds; load average %.2f on %d cores\n",
		*mode, *conc, *messages, *rounds, loadAverage(), res.Machine.Cores)
	for round := 1; round <= *rounds; round++ {
		order := slices.Clone(procs)
		if round%2 == 0 {
			slices.Reverse(order)
		}
		for _, b := range brokers {
			for _, n := range order {
				cell, err := d.run(ctx, b, brokerURL[b], n)
				if err != nil {
					return fmt.Errorf("round %d, %s with %d processes: %w", round, b, n, err)
				}
				cell.Round = round
				res.Cells = append(res.Cells, cell)
				fmt.Fprintf(os.Stderr, "round %d %-6s %-11s %6d msgs  %7.0f msgs/s  machine cpu %.2f\n",
					round, b, processes(n), cell.Messages, cell.MsgsPerS, cell.MachineCPU)
			}
		}
	}

	fmt.Printf("\nscale-out: one handler (%s, Concurrency %d per process) in 1 to %d processes against one PostgreSQL, msgs/s, median of %d rounds:\n",
		*mode, *conc, slices.Max(procs), *rounds)
	for _, b := range brokers {
		var one float64
		for _, n := range procs {
			var rates []float64
			for _, c := range res.Cells {
				if c.Broker == b && c.Processes == n {
					rates = append(rates, c.MsgsPerS)
				}
			}
			sort.Float64s(rates)
			med := rates[len(rates)/2]
			if n == procs[0] {
				one = med
			}
			m := ScaleOutMedian{Broker: b, Processes: n, MsgsPerS: med, Scaling: round2(med / one)}
			res.Medians = append(res.Medians, m)
			fmt.Printf("  %-6s %-11s %7.0f msgs/s  %.2fx %s\n", b, processes(n), med, m.Scaling, processes(procs[0]))
		}
	}
	fmt.Printf("(%d cores: the processes share them with the broker and the database; see docs/scaling.md)\n", res.Machine.Cores)
	if err := writeJSON(*out, res); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "wrote %s\n", *out)
	return nil
}

// processes says "1 process", "2 processes"...
func processes(n int) string {
	if n == 1 {
		return "1 process"
	}
	return fmt.Sprintf("%d processes", n)
}

// scaleOutDrain is one configuration of the scale-out benchmark.
type scaleOutDrain struct {
	exe string
	// kafkaSeeds are the in-process Kafka cluster's brokers, for its admin client.
	kafkaSeeds []string
	db         *sqldb.DB
	dbURL      string
	messages   int
	conc       int
	mode       string
	payload    []byte
}

// run drains d.messages with n consumer processes of one handler on brokerName and returns the
// rate. On RabbitMQ the messages are published first and the clock starts once every process
// has subscribed. On Kafka each process's subscriptions join the consumer group, and each join
// stops the group for a rebalance: the processes first apply a few messages while the group
// settles, and the clock starts when the group is stable with every member assigned, as the
// rest of the messages are published in batches, much faster than they are applied.
func (d scaleOutDrain) run(ctx context.Context, brokerName, brokerURL string, n int) (ScaleOutCell, error) {
	cell := ScaleOutCell{Broker: brokerName, Processes: n, Messages: d.messages}
	id := newID()
	tables := newCellTables(id)
	if err := tables.create(ctx, d.db); err != nil {
		return cell, err
	}
	defer tables.drop(context.WithoutCancel(ctx), d.db)
	topicName := "bench_scaleout_" + id
	group := consumerGroup // the AMQP queue publishAMQP binds is "<topic>.bench"

	var publish func(from, to int) error
	total := d.messages
	switch brokerName {
	case "amqp":
		if err := publishAMQP(ctx, brokerURL, topicName, d.messages, d.payload); err != nil {
			return cell, err
		}
		defer deleteAMQPTopic(brokerURL, topicName)
	case "kafka":
		group += "_" + id // a Kafka group of its own, starting at the topic's beginning
		b, err := broker.Open(ctx, brokerURL, broker.Options{ConsumerGroup: group})
		if err != nil {
			return cell, err
		}
		defer b.Close()
		publish = func(from, to int) error {
			for start := from; start < to; start += 1000 {
				batch := make([]*message.Message, 0, 1000)
				for i := start; i < min(start+1000, to); i++ {
					batch = append(batch, message.NewMessage(fmt.Sprintf("%s-%d", id, i), d.payload))
				}
				if err := b.Publisher().Publish(topicName, batch...); err != nil {
					return err
				}
			}
			return nil
		}
		if err := publish(0, scaleOutWarm); err != nil {
			return cell, err
		}
		total += scaleOutWarm
	}

	procs := make([]*scaleOutProc, n)
	defer func() {
		for _, p := range procs {
			if p != nil {
				p.stop()
			}
		}
	}()
	for i := range procs {
		p, err := d.start(ctx, brokerURL, group, topicName, tables)
		if err != nil {
			return cell, err
		}
		procs[i] = p
	}
	processed := func() int {
		sum := 0
		for _, p := range procs {
			sum += int(p.processed.Load())
		}
		return sum
	}
	if err := waitFor(ctx, time.Minute, func() bool {
		for _, p := range procs {
			if !p.ready.Load() {
				return false
			}
		}
		return true
	}); err != nil {
		return cell, errors.New("the consumers did not subscribe within a minute")
	}
	if brokerName == "kafka" {
		if err := waitFor(ctx, time.Minute, func() bool { return processed() >= scaleOutWarm }); err != nil {
			return cell, fmt.Errorf("the consumers did not apply the first %d messages within a minute", scaleOutWarm)
		}
		if err := waitSettled(ctx, d.kafkaSeeds, group, n*d.conc); err != nil {
			return cell, err
		}
	}

	before, start := sampleCPU(), time.Now()
	if publish != nil {
		if err := publish(scaleOutWarm, total); err != nil {
			return cell, err
		}
	}
	if err := waitFor(ctx, 10*time.Minute, func() bool { return processed() >= total }); err != nil {
		return cell, fmt.Errorf("%d of %d messages applied within 10 minutes", processed(), total)
	}
	took := time.Since(start).Seconds()
	cell.Seconds = round2(took)
	cell.MsgsPerS = float64(int(float64(d.messages) / took))
	cell.MachineCPU = cpuUse(before, sampleCPU())["machine"]

	var effects, distinct int
	if err := d.db.QueryRowContext(ctx, `SELECT COUNT(*), COUNT(DISTINCT message_id) FROM `+tables.effects).Scan(&effects, &distinct); err != nil {
		return cell, err
	}
	if effects != total || distinct != total {
		return cell, fmt.Errorf("%d effects of %d distinct messages, want %d of each: not exactly once", effects, distinct, total)
	}
	return cell, nil
}

// scaleOutProc is one consumer process.
type scaleOutProc struct {
	cmd       *exec.Cmd
	ready     atomic.Bool
	processed atomic.Int64
	done      chan struct{}
}

// start starts a consumer process of the handler on topicName.
func (d scaleOutDrain) start(ctx context.Context, brokerURL, group, topicName string, tables cellTables) (*scaleOutProc, error) {
	cmd := exec.CommandContext(ctx, d.exe, consumerCommand, "-broker", brokerURL, "-group", group, "-db", d.dbURL, "-topic", topicName,
		"-dedup-table", tables.dedup, "-effects-table", tables.effects, "-mode", d.mode, "-concurrency", fmt.Sprint(d.conc),
		"-report-every", "20ms")
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &scaleOutProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var n, heap int64
			if sc.Text() == "ready" {
				p.ready.Store(true)
			} else if _, err := fmt.Sscanf(sc.Text(), "processed %d heap %d", &n, &heap); err == nil {
				p.processed.Store(n)
			}
		}
		_ = cmd.Wait()
	}()
	return p, nil
}

// stop ends the process gracefully, or kills it after 10 s.
func (p *scaleOutProc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// waitFor polls cond every 10 ms until it holds, ctx ends or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// waitSettled waits until the Kafka consumer group has members members, each assigned
// partitions, and is stable.
func waitSettled(ctx context.Context, seeds []string, group string, members int) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
	if err != nil {
		return err
	}
	defer cl.Close()
	admin := kadm.NewClient(cl)
	err = waitFor(ctx, time.Minute, func() bool {
		return kafkatest.Settled(ctx, admin, group, members)
	})
	if err != nil {
		return fmt.Errorf("the consumer group %s did not settle with %d members within a minute", group, members)
	}
	return nil
}
