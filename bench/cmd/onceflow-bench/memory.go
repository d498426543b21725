package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"runtime/metrics"
	"slices"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// consumerCommand is the hidden command the memory and scale-out benchmarks re-execute
// themselves with: one consumer process, measured apart from the driver.
const consumerCommand = "consumer"

// MemoryResults is what bench/results/memory.json holds.
type MemoryResults struct {
	Date        string            `json:"date"`
	Machine     Machine           `json:"machine"`
	Versions    map[string]string `json:"versions"`
	Config      map[string]any    `json:"config"`
	Messages    int64             `json:"messages"`
	Seconds     float64           `json:"seconds"`
	MsgsPerS    float64           `json:"msgs_per_s"`
	PeakRSSMiB  float64           `json:"peak_rss_mib"` // VmHWM at the end
	RSSAt10MiB  float64           `json:"rss_at_10pct_mib"`
	RSSAt50MiB  float64           `json:"rss_at_50pct_mib"`
	RSSEndMiB   float64           `json:"rss_end_mib"`
	SlopeKiB    float64           `json:"rss_slope_kib_per_100k_msgs"` // least squares, after the first 10%
	HeapEndMiB  float64           `json:"go_heap_end_mib"`
	Flat        bool              `json:"flat"`
	Under100MiB bool              `json:"under_100_mib"`
	Samples     []memSample       `json:"samples"`
}

type memSample struct {
	Seconds   float64 `json:"s"`
	Processed int64   `json:"processed"`
	RSSKiB    int64   `json:"rss_kib"`
	HeapKiB   int64   `json:"heap_kib"`
}

func runMemory(ctx context.Context, args []string) error {
	svc := defaultServices()
	fs := flag.NewFlagSet("memory", flag.ContinueOnError)
	n := fs.Int64("messages", 1_000_000, "messages the consumer processes")
	conc := fs.Int("concurrency", 16, "handler concurrency of the consumer")
	payloadSize := fs.Int("payload", 1024, "payload bytes per message")
	mode := fs.String("mode", vExactlyOnce, "atleastonce, exactlyonce or exactlyonce-gc")
	backlog := fs.Int64("backlog", 20000, "most messages published ahead of the consumer (RabbitMQ keeps them)")
	out := fs.String("out", "bench/results/memory.json", "results file")
	fs.StringVar(&svc.postgres, "postgres", svc.postgres, "PostgreSQL URL")
	fs.StringVar(&svc.amqp, "amqp", svc.amqp, "RabbitMQ URL")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if os.Getenv("BENCH_QUICK") == "1" {
		*n = min(*n, 20000)
	}
	if !slices.Contains([]string{vAtLeastOnce, vExactlyOnce, vGroupCommit}, *mode) {
		return fmt.Errorf("-mode: %q is not atleastonce, exactlyonce or exactlyonce-gc", *mode)
	}
	res := MemoryResults{
		Date: time.Now().UTC().Format(time.RFC3339), Machine: describeMachine(),
		Versions: versions(ctx, svc, []setup{{Database: "postgres", Broker: "amqp"}}),
		Config:   map[string]any{"messages": *n, "concurrency": *conc, "payload_bytes": *payloadSize, "mode": *mode, "broker": "amqp", "database": "postgres"},
	}
	schema := benchSchema + "_memory"
	dbURL, err := preparePostgres(ctx, svc.postgres, schema)
	if err != nil {
		return err
	}
	defer dropSchema(svc.postgres, schema) // a million rows of 1 KiB
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	id := newID()
	tables := newCellTables(id)
	if err := tables.create(ctx, db); err != nil {
		return err
	}
	topic := "bench_memory_" + id
	if err := publishAMQP(ctx, svc.amqp, topic, 0, nil); err != nil { // declares the topology
		return err
	}
	defer deleteAMQPTopic(svc.amqp, topic)

	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, exe, consumerCommand, "-broker", svc.amqp, "-db", dbURL, "-topic", topic,
		"-dedup-table", tables.dedup, "-effects-table", tables.effects, "-mode", *mode, "-concurrency", fmt.Sprint(*conc))
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	var processed, heap atomic.Int64
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var p, h int64
			if sc.Text() == "ready" {
				close(ready)
			} else if _, err := fmt.Sscanf(sc.Text(), "processed %d heap %d", &p, &h); err == nil {
				processed.Store(p)
				heap.Store(h)
			}
		}
	}()
	select {
	case <-ready:
	case <-time.After(time.Minute):
		return errors.New("the consumer did not start within a minute")
	case <-ctx.Done():
		return ctx.Err()
	}

	// Publish while the consumer runs, keeping at most backlog messages ahead of it.
	payload := newPayload(*payloadSize)
	pubErr := make(chan error, 1)
	go func() {
		var published int64
		for published < *n {
			if published-processed.Load() >= *backlog {
				select {
				case <-ctx.Done():
					pubErr <- ctx.Err()
					return
				case <-time.After(50 * time.Millisecond):
				}
				continue
			}
			chunk := min(*n-published, 5000)
			if err := publishAMQP(ctx, svc.amqp, topic, int(chunk), payload); err != nil {
				pubErr <- err
				return
			}
			published += chunk
		}
		pubErr <- nil
	}()

	fmt.Fprintf(os.Stderr, "consumer pid %d: %s at concurrency %d, %d messages of %d bytes\n", cmd.Process.Pid, *mode, *conc, *n, *payloadSize)
	start := time.Now()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	lastLog := start
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-pubErr:
			if err != nil {
				return fmt.Errorf("publish: %w", err)
			}
		case <-tick.C:
		}
		rss, hwm, err := readRSS(cmd.Process.Pid)
		if err != nil {
			return fmt.Errorf("the consumer is gone: %w", err)
		}
		p := processed.Load()
		res.Samples = append(res.Samples, memSample{Seconds: round2(time.Since(start).Seconds()), Processed: p, RSSKiB: rss, HeapKiB: heap.Load() / 1024})
		res.PeakRSSMiB = round2(float64(hwm) / 1024)
		if time.Since(lastLog) >= 10*time.Second {
			lastLog = time.Now()
			fmt.Fprintf(os.Stderr, "[%5.0fs] %8d/%d processed  RSS %6.1f MiB  peak %6.1f MiB  Go heap %6.1f MiB\n",
				time.Since(start).Seconds(), p, *n, float64(rss)/1024, float64(hwm)/1024, float64(heap.Load())/(1<<20))
		}
		if p >= *n {
			break
		}
	}
	res.Seconds = round2(time.Since(start).Seconds())
	res.Messages = processed.Load()
	res.MsgsPerS = float64(int(float64(res.Messages) / res.Seconds))
	_ = cmd.Process.Signal(syscall.SIGTERM)
	summarizeMemory(&res, *n)
	fmt.Printf("\nmemory of one consumer (%s, concurrency %d, %d-byte payloads, RabbitMQ -> PostgreSQL):\n", *mode, *conc, *payloadSize)
	fmt.Printf("  %d messages in %.0f s (%.0f msgs/s)\n", res.Messages, res.Seconds, res.MsgsPerS)
	fmt.Printf("  peak RSS %.1f MiB (target < 100 MiB: %s)\n", res.PeakRSSMiB, metStr(res.Under100MiB))
	fmt.Printf("  RSS at 10%% %.1f MiB, at 50%% %.1f MiB, at the end %.1f MiB; slope %.0f KiB per 100k messages after 10%% (flat: %s)\n",
		res.RSSAt10MiB, res.RSSAt50MiB, res.RSSEndMiB, res.SlopeKiB, metStr(res.Flat))
	fmt.Printf("  Go heap at the end %.1f MiB\n", res.HeapEndMiB)
	// Keep the JSON small: at most about 300 samples.
	if step := len(res.Samples)/300 + 1; step > 1 {
		var kept []memSample
		for i := 0; i < len(res.Samples); i += step {
			kept = append(kept, res.Samples[i])
		}
		res.Samples = append(kept, res.Samples[len(res.Samples)-1])
	}
	if err := writeJSON(*out, res); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "wrote %s\n", *out)
	return nil
}

func metStr(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT MET"
}

// summarizeMemory computes RSS at 10%, 50% and the end, and the least-squares slope of RSS
// over messages processed after the first 10% (the warm-up: pools, buffers and caches fill).
// Flat means the slope projects less than 10% of the RSS at 10% over the whole run.
func summarizeMemory(res *MemoryResults, n int64) {
	at := func(frac float64) float64 {
		for _, s := range res.Samples {
			if float64(s.Processed) >= frac*float64(n) {
				return round2(float64(s.RSSKiB) / 1024)
			}
		}
		return 0
	}
	res.RSSAt10MiB, res.RSSAt50MiB = at(0.1), at(0.5)
	if k := len(res.Samples); k > 0 {
		res.RSSEndMiB = round2(float64(res.Samples[k-1].RSSKiB) / 1024)
		res.HeapEndMiB = round2(float64(res.Samples[k-1].HeapKiB) / 1024)
	}
	var xs, ys []float64
	for _, s := range res.Samples {
		if float64(s.Processed) >= 0.1*float64(n) {
			xs = append(xs, float64(s.Processed))
			ys = append(ys, float64(s.RSSKiB))
		}
	}
	if len(xs) >= 2 {
		var mx, my float64
		for i := range xs {
			mx += xs[i]
			my += ys[i]
		}
		mx /= float64(len(xs))
		my /= float64(len(ys))
		var num, den float64
		for i := range xs {
			num += (xs[i] - mx) * (ys[i] - my)
			den += (xs[i] - mx) * (xs[i] - mx)
		}
		if den > 0 {
			res.SlopeKiB = float64(int(num / den * 100_000))
		}
	}
	res.Under100MiB = res.PeakRSSMiB > 0 && res.PeakRSSMiB < 100
	res.Flat = res.RSSAt10MiB > 0 && res.SlopeKiB*float64(n)/100_000 < 0.1*res.RSSAt10MiB*1024
}

// runConsumer is one consumer process of the memory and scale-out benchmarks: an onceflow
// Router on a broker and PostgreSQL that applies each message as one business row, and reports
// on stdout "ready", then every -report-every "processed N heap B" (B: Go heap objects in
// bytes), until SIGTERM.
func runConsumer(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(consumerCommand, flag.ContinueOnError)
	brokerURL := fs.String("broker", "", "broker URL")
	group := fs.String("group", consumerGroup, "consumer group")
	dbURL := fs.String("db", "", "database URL")
	topic := fs.String("topic", "", "topic")
	dedupTable := fs.String("dedup-table", "", "dedup table")
	effects := fs.String("effects-table", "", "business table")
	mode := fs.String("mode", vExactlyOnce, "variant")
	conc := fs.Int("concurrency", 16, "handler concurrency")
	every := fs.Duration("report-every", 500*time.Millisecond, "how often to report the messages processed")
	if err := fs.Parse(args); err != nil {
		return err
	}
	db, err := sqldb.Open(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer db.Close()
	b, err := broker.Open(ctx, *brokerURL, broker.Options{ConsumerGroup: *group})
	if err != nil {
		return err
	}
	defer b.Close()
	var processed atomic.Int64
	insert := effectInsert(db, *effects)
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	stop, err := startRouter(ctx, b, db, *topic, *dedupTable, *mode, *conc, logger, processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		tx, _ := middleware.CurrentTx(ctx)
		if _, err := tx.ExecContext(ctx, insert, msg.ID, msg.Payload); err != nil {
			return err
		}
		processed.Add(1)
		return nil
	}))
	if err != nil {
		return err
	}
	fmt.Println("ready")
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	tick := time.NewTicker(*every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return stop()
		case <-tick.C:
			metrics.Read(sample)
			fmt.Printf("processed %d heap %d\n", processed.Load(), sample[0].Value.Uint64())
		}
	}
}
