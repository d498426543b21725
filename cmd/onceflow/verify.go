package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cmd/onceflow/internal/verify"
)

func newVerifyCommand() *cobra.Command {
	var cfg verify.Config
	var modes, poison []string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "verify",
		Short: "Measure lost and duplicated effects under injected crashes, per quality of service",
		Long: `verify publishes messages with unique ids, runs competing consumer processes that apply one
effect per message to the database, and injects faults: it kills consumers with SIGKILL at random
moments and at each crash point (after receive, after the write before commit, after commit before
ack, after a dead letter's publish before its record), makes a few messages fail or panic once
after their write, and cuts their database and broker connections through a loopback TCP proxy.
Then it counts the effects per message id: lost = none, duplicated = more than one. It runs each
mode's handler under package onceflowtest, which proves a handler of one's own the same way in
go test (docs/testing.md).

Among the good messages it publishes poison messages, one of each kind: a data error (its INSERT
violates NOT NULL), a panic every time, a malformed payload, an id of 300 bytes (where the broker's
publisher carries it, in the modes that record ids), and one that kills its consumer process every
time (published first, alone). Each must be dead-lettered exactly once, with its reason, within the
delivery limit (--max-deliveries, 5); a copy published again under the same dead-letter key is
counted apart. BestEffort has no dead-letter topic and gets none.

ExactlyOnceBatch is ExactlyOnce with a batch processor (Handler.BatchProcessor, which implies group
commit): one multi-row INSERT per group of messages. Two more modes, not in the default list, run
only where the broker has them: ExactlyOnceByOffset (Kafka: each partition's last applied offset
written in the handler's transaction, no dedup row; middleware.DedupByOffset) and
ExactlyOnceAckInTx (the PostgreSQL or MySQL queue in the handler's database, --broker and --db the
same URL: the message taken off the queue in the handler's transaction;
middleware.DedupAckInTransaction). Both detect redeliveries, not a second publish of an id, so they
refuse --duplicates.

The result is the classic delivery-guarantee table (maybe, at least once, exactly once;
see docs/background.md), measured. With no flags it runs on the embedded
SQLite queue and database, with no service to set up; --broker and --db select real ones. The exit
status is 3 when an exactly-once mode lost or duplicated anything, or did not dead-letter each
of its poison messages exactly once.`,
		Example: `  onceflow verify
  onceflow verify --messages 2000 --kills 5 --json
  onceflow verify --broker amqp://guest:guest@127.0.0.1:5672/ --db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			for _, m := range modes {
				mode, err := verify.ParseMode(m)
				if err != nil {
					return usagef("--modes: %w", err)
				}
				cfg.Modes = append(cfg.Modes, mode)
			}
			cfg.Poison = verify.NoPoison
			for _, k := range poison {
				if k == "none" {
					continue
				}
				kind, err := verify.ParsePoisonKind(k)
				if err != nil {
					return usagef("--poison: %w", err)
				}
				cfg.Poison = append(cfg.Poison, kind)
			}
			if cfg.Kills == 0 {
				cfg.Kills = verify.None
			}
			if cfg.Cuts == 0 {
				cfg.Cuts = verify.None
			}
			cfg.Progress = cmd.ErrOrStderr()
			// The account of each message that went wrong, and consumers that failed to start.
			cfg.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			if asJSON {
				cfg.Progress = nil
			}
			report, err := verify.Run(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				if err := enc.Encode(report); err != nil {
					return err
				}
			} else {
				printReport(cmd.OutOrStdout(), report)
			}
			if !report.ExactlyOnceHeld() {
				return &exitError{code: exitViolation, err: errors.New("exactly-once did not hold: see the table")}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.BrokerURL, "broker", "", "broker URL (default: an embedded SQLite queue)")
	f.StringVar(&cfg.DBURL, "db", "", "application database URL (default: an embedded SQLite database)")
	f.StringVar(&cfg.Dir, "dir", "", "directory for the embedded files and the consumers' logs (default: a temporary directory, removed)")
	f.BoolVar(&cfg.KeepDir, "keep", false, "keep the directory after the run")
	f.IntVar(&cfg.Messages, "messages", 10000, "distinct messages per mode")
	f.IntVar(&cfg.Duplicates, "duplicates", 0, "deliberate second publishes of already published ids, per mode")
	f.IntVar(&cfg.Consumers, "consumers", 3, "competing consumer processes")
	f.IntVar(&cfg.Concurrency, "concurrency", 4, "handler concurrency inside each consumer")
	f.IntVar(&cfg.Kills, "kills", 20, "SIGKILLs at random moments per mode (each restart also dies once at a crash point)")
	f.IntVar(&cfg.Cuts, "cuts", 5, "connection cuts per mode, alternating broker and database (network services only)")
	f.StringSliceVar(&modes, "modes", []string{"BestEffort", "AtLeastOnce", "ExactlyOnce", "ExactlyOnceInOrder", "ExactlyOnceBatch"}, "modes to measure")
	f.StringSliceVar(&poison, "poison", kindNames(verify.PoisonKinds), "poison messages to publish among the good ones, one of each kind (none for none)")
	f.IntVar(&cfg.MaxDeliveries, "max-deliveries", 5, "the consumers' delivery limit")
	f.IntVar(&cfg.Keys, "keys", 100, "ordering keys in ExactlyOnceInOrder mode")
	f.BoolVar(&cfg.GroupCommit, "group-commit", false, "run the exactly-once modes with group commit")
	f.Uint64Var(&cfg.Seed, "seed", 0, "seed of the fault schedule (default: random; printed in the report)")
	f.BoolVar(&asJSON, "json", false, "print one JSON object on stdout and nothing else")
	return cmd
}

func kindNames(kinds []verify.PoisonKind) []string {
	out := make([]string, len(kinds))
	for i, k := range kinds {
		out[i] = string(k)
	}
	return out
}

// printReport writes the measured table beside what the delivery-guarantee table promises.
func printReport(w io.Writer, r verify.Report) {
	fmt.Fprintf(w, "broker %s, database %s, seed %d\n\n", r.Broker, r.Database, r.Seed)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tmessages\tkills\tcuts\tlost\tduplicated\tout of order\tpoison\tmsgs/s\t")
	for _, m := range r.Modes {
		order := "-"
		if m.OrderViolations != nil {
			order = fmt.Sprint(*m.OrderViolations)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%.0f\t\n", m.Mode, m.Messages, m.Kills, m.Cuts, m.Lost, m.Duplicated, order, poisonCell(m.Poison), m.MsgsPerSec)
	}
	tw.Flush()
	fmt.Fprintln(w, "\npoison: poison messages dead-lettered exactly once / published (kills by the crash loop are not in kills)")
	left := map[verify.PoisonKind]string{}
	for _, m := range r.Modes {
		if m.Poison != nil {
			for k, why := range m.Poison.Left {
				if verify.PoisonKind(k) == verify.PoisonLongID && strings.HasPrefix(why, "not poison") {
					continue // without duplicate detection, which the column says
				}
				left[verify.PoisonKind(k)] = why
			}
		}
	}
	for _, k := range verify.PoisonKinds {
		if why, ok := left[k]; ok {
			fmt.Fprintf(w, "%s left out: %s\n", k, why)
		}
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "mode\tpromised (persistent broker)\tmeasured")
	for _, m := range r.Modes {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", m.Mode, m.Expected, m.Verdict)
	}
	tw.Flush()
}

// poisonCell is the poison column of a mode: dead-lettered exactly once / published, and the
// messages dead-lettered more than once, or good ones dead-lettered, if any.
func poisonCell(p *verify.PoisonResult) string {
	if p == nil {
		return "-"
	}
	cell := fmt.Sprintf("%d/%d", p.DeadLettered-p.Twice, p.Published)
	if p.Twice > 0 {
		cell += fmt.Sprintf(" (%d twice)", p.Twice)
	}
	if p.Copies > 0 {
		cell += fmt.Sprintf(" (%d copies)", p.Copies)
	}
	if p.GoodDeadLettered > 0 {
		cell += fmt.Sprintf(" (+%d good)", p.GoodDeadLettered)
	}
	return cell
}

// newVerifyConsumerCommand is the consumer process that verify starts; it is not meant to be
// run by hand.
func newVerifyConsumerCommand() *cobra.Command {
	var cfg verify.ConsumerConfig
	var mode string
	cmd := &cobra.Command{
		Use:    "verify-consumer",
		Short:  "One consumer process of onceflow verify",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			q, err := onceflow.ParseQoS(mode)
			if err != nil {
				return err
			}
			cfg.Mode = q
			err = verify.Consume(cmd.Context(), cfg)
			if errors.Is(err, context.Canceled) {
				return nil // SIGTERM from verify: a graceful stop
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Topic, "topic", "", "topic")
	f.StringVar(&cfg.Name, "handler", "", "handler name")
	f.StringVar(&mode, "mode", "ExactlyOnce", "quality of service")
	f.BoolVar(&cfg.GroupCommit, "group-commit", false, "group commit")
	f.BoolVar(&cfg.Batch, "batch", false, "a batch processor (implies group commit)")
	f.StringVar((*string)(&cfg.Dedup), "dedup", "", "how duplicates are detected: by id (empty), ByOffset or AckInTx")
	f.IntVar(&cfg.MaxDeliveries, "max-deliveries", 0, "delivery limit (0: the router's default)")
	f.StringVar(&cfg.RunID, "run", "", "run id")
	f.IntVar(&cfg.Concurrency, "concurrency", 1, "handler concurrency")
	return cmd
}
