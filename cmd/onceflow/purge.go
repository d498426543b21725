package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/sqldb"
)

func newPurgeCommand() *cobra.Command {
	var f tableFlags
	var batch, maxBatches int
	var queueURL string
	var topics []string
	cmd := &cobra.Command{
		Use:   "purge",
		Short: "Delete expired duplicate-detection keys, and sent outbox messages, in bounded batches",
		Long: `Deletes the duplicate-detection keys whose retention has passed, batch by batch, each
batch in its own short statement; with --outbox also the outbox messages that every relay group
has sent, with --deliveries the delivery counts kept past their retention; --all does all three.
Only one purge runs on a table at a time, whatever the node: PostgreSQL takes an advisory lock,
MySQL/MariaDB GET_LOCK, SQLite a file lock. A purge that finds the lock held does nothing and
says so.

With --queue and --topic it also trims the PostgreSQL, MySQL or SQLite queue at that URL:
it deletes the messages of each topic that every consumer group of the topic has acknowledged,
in statements of at most 1,000 rows. Those queues keep a message after its acknowledgement, for
the consumer groups that subscribe later, and grow until trimmed; a group that subscribes for
the first time after a trim does not see the deleted messages. Trim from one process at a
time.

The database and its tables must exist: purge creates nothing, and says to run onceflow migrate
when a table is missing. Retention is fixed when a key is recorded (the handler's
Dedup.Retention); it must outlive the longest time the broker may take to redeliver a message.
The relays purge the outbox themselves as they go (outbox.RelayConfig.PurgeInterval).`,
		Example: `  onceflow purge --db sqlite://var/app.db
  DATABASE_URL=postgres://app@db:5432/app onceflow purge --all --max-batches 100
  onceflow purge --db sqlite://var/app.db --queue sqlite://var/queue.db --topic orders --topic payments`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			url, err := f.resolve()
			if err != nil {
				return err
			}
			if batch < 0 || maxBatches < 0 {
				return usagef("--batch-size %d, --max-batches %d: want numbers that are not negative", batch, maxBatches)
			}
			if (queueURL == "") != (len(topics) == 0) {
				return usagef("--queue and --topic go together: the queue to trim, and each of its topics")
			}
			ctx, out := cmd.Context(), cmd.OutOrStdout()
			conn, err := sqldb.OpenExisting(ctx, url)
			if err != nil {
				return withMigrateHint(err, url)
			}
			defer conn.Close()
			opts := dedup.PurgeOptions{BatchSize: batch, MaxBatches: maxBatches}

			store, err := dedup.New(conn, dedup.Config{Table: f.dedupTable})
			if err != nil {
				return usageError(err)
			}
			if err := requireTable(ctx, conn, store.Table(), "duplicate-detection table", ""); err != nil {
				return err
			}
			res, err := store.Purge(ctx, opts)
			if err != nil {
				return fmt.Errorf("purge %s on %s: %w", store.Table(), conn, err)
			}
			reportPurge(out, res, "expired key", store.Table())

			if f.withDeliveries {
				counter, err := dedup.NewCounter(conn, dedup.CounterConfig{Table: f.deliveriesTable})
				if err != nil {
					return usageError(err)
				}
				if err := requireTable(ctx, conn, counter.Table(), "delivery counter table", "--deliveries"); err != nil {
					return err
				}
				res, err := counter.Purge(ctx, opts)
				if err != nil {
					return fmt.Errorf("purge %s on %s: %w", counter.Table(), conn, err)
				}
				reportPurge(out, res, "expired delivery count", counter.Table())
			}
			if f.withOutbox {
				ob, err := outbox.New(conn, outbox.Config{Table: f.outboxTable})
				if err != nil {
					return usageError(err)
				}
				messages, _ := ob.Tables()
				if err := requireTable(ctx, conn, messages, "outbox table", "--outbox"); err != nil {
					return err
				}
				res, err := ob.Purge(ctx, outbox.PurgeOptions{BatchSize: batch, MaxBatches: maxBatches})
				if err != nil {
					return fmt.Errorf("purge outbox %s on %s: %w", ob.Table(), conn, err)
				}
				fmt.Fprintf(out, "purged %s from outbox %s in %s\n", plural(int(res.Deleted), "sent message"), ob.Table(), plural(res.Batches, "batch"))
			}
			if queueURL != "" {
				return trimQueue(ctx, out, queueURL, topics)
			}
			return nil
		},
	}
	f.register(cmd, false)
	fl := cmd.Flags()
	fl.StringVar(&f.dedupTable, "table", dedup.DefaultTable, "duplicate-detection table")
	_ = fl.MarkDeprecated("table", "use --dedup-table, as migrate does")
	fl.IntVar(&batch, "batch-size", dedup.DefaultPurgeBatchSize, "rows deleted per statement")
	fl.IntVar(&maxBatches, "max-batches", 0, "stop after this many batches of each table (0: until nothing purgeable is left)")
	fl.StringVar(&queueURL, "queue", "", "URL of a PostgreSQL, MySQL or SQLite queue (postgres://, mysql://, sqlite://) to trim of acknowledged messages, with --topic")
	fl.StringArrayVar(&topics, "topic", nil, "a topic of --queue to trim (repeat for several)")
	return cmd
}

// trimQueue deletes the messages of topics that every consumer group of each has acknowledged
// from the queue at queueURL.
func trimQueue(ctx context.Context, out io.Writer, queueURL string, topics []string) error {
	b, err := broker.Open(ctx, queueURL, broker.Options{MustExist: true, ReportNotFound: true})
	if err != nil {
		return err
	}
	defer b.Close()
	for _, topic := range topics {
		n, err := b.Trim(ctx, topic)
		if errors.Is(err, errors.ErrUnsupported) {
			return usageError(err)
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "trimmed %s from topic %s of %s\n", plural(int(n), "acknowledged message"), topic, b)
	}
	return nil
}

// reportPurge prints what a purge of table did, or that another purge held it.
func reportPurge(w io.Writer, res dedup.PurgeResult, noun, table string) {
	if res.Skipped {
		fmt.Fprintf(w, "skipped: another purge of %s is running\n", table)
		return
	}
	fmt.Fprintf(w, "purged %s from %s in %s\n", plural(int(res.Deleted), noun), table, plural(res.Batches, "batch"))
}

// requireTable fails, saying to run migrate with flag, when conn has no table name.
func requireTable(ctx context.Context, conn *sqldb.DB, name, what, flag string) error {
	ok, err := conn.TableExists(ctx, name)
	if err != nil {
		return err
	}
	if !ok {
		migrate := "onceflow migrate"
		if flag != "" {
			migrate += " " + flag
		}
		return fmt.Errorf("no %s %s in %s: create it with %s", what, name, conn, migrate)
	}
	return nil
}

// withMigrateHint adds to an error of OpenExisting how to create the database.
func withMigrateHint(err error, url string) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w (create it with onceflow migrate --db %s)", err, sqldb.Redact(url))
	}
	return err
}
