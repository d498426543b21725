// Command onceflow-bench measures onceflow end to end, beside the baselines it must be compared
// with, in the same run:
//
//	onceflow-bench run      RabbitMQ -> PostgreSQL and MariaDB, and the embedded SQLite default:
//	                        AtLeastOnce, ExactlyOnce per message, ExactlyOnce with group commit,
//	                        a hand-written watermill baseline and the database's own limit
//	                        (pgbench, or a Go loop of the same statements), at concurrency 1, 4
//	                        and 16; writes bench/results/latest.json and docs/performance.svg
//	onceflow-bench scale    ExactlyOnce with 10 million dedup keys against an empty table, and
//	                        with the retention purge running at the same time
//	onceflow-bench memory   peak RSS of one consumer process at concurrency 16 with 1 KiB
//	                        payloads, and its growth over 1 million messages
//	onceflow-bench scaleout one handler in 1, 2 and 4 consumer processes on RabbitMQ and on an
//	                        in-process Kafka cluster against one PostgreSQL: the scaling ratio
//
// Absolute numbers depend on the machine and on what else runs on it: every comparison is a
// ratio of variants measured side by side, interleaved in rounds, and reported as medians.
// docs/performance.md explains the method and records a run.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	_ "github.com/onceflow/onceflow/broker/all"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "onceflow-bench:", err)
		os.Exit(1)
	}
}

const usage = `usage: onceflow-bench <command> [flags]

commands:
  run       the end-to-end suite (make bench)
  scale     dedup at scale: 10 million keys, with and without purge (make bench-scale)
  memory    peak RSS and growth of one consumer over 1 million messages (make bench-memory)
  scaleout  one handler in 1, 2 and 4 processes, RabbitMQ and Kafka into PostgreSQL (make bench-scaleout)
  chart     draw the chart of a results file again (-in results.json -out chart.svg|.png)

Run "onceflow-bench <command> -h" for the flags of a command.`

func run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return errors.New(usage)
	}
	switch args[0] {
	case "run":
		return runSuite(ctx, args[1:])
	case "scale":
		return runScale(ctx, args[1:])
	case "memory":
		return runMemory(ctx, args[1:])
	case "scaleout":
		return runScaleOut(ctx, args[1:])
	case "chart":
		return runChart(args[1:])
	case consumerCommand:
		return runConsumer(ctx, args[1:])
	case "-h", "-help", "--help", "help":
		fmt.Println(usage)
		return nil
	}
	return fmt.Errorf("unknown command %q\n\n%s", args[0], usage)
}
