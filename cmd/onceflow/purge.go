package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/sqldb"
)

func newPurgeCommand() *cobra.Command {
	var db, table string
	var batch, maxBatches int
	cmd := &cobra.Command{
		Use:   "purge",
		Short: "Delete expired duplicate-detection keys in bounded batches",
		Long: `Deletes the duplicate-detection keys whose retention has passed, batch by batch, each
batch in its own short statement. Only one purge runs on a table at a time, whatever the node:
PostgreSQL takes an advisory lock, MySQL/MariaDB GET_LOCK, SQLite a file lock. A purge that
finds the lock held does nothing and says so.

Retention is fixed when a key is recorded (the handler's Dedup.Retention); it must outlive the
longest time the broker may take to redeliver a message.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			url, err := dbURL(db)
			if err != nil {
				return err
			}
			conn, err := sqldb.Open(cmd.Context(), url)
			if err != nil {
				return err
			}
			defer conn.Close()
			store, err := dedup.New(conn, dedup.Config{Table: table})
			if err != nil {
				return err
			}
			res, err := store.Purge(cmd.Context(), dedup.PurgeOptions{BatchSize: batch, MaxBatches: maxBatches})
			if err != nil {
				return fmt.Errorf("purge %s on %s: %w", store.Table(), conn, err)
			}
			out := cmd.OutOrStdout()
			if res.Skipped {
				fmt.Fprintf(out, "skipped: another purge of %s is running\n", store.Table())
				return nil
			}
			fmt.Fprintf(out, "purged %d expired keys from %s in %d batches\n", res.Deleted, store.Table(), res.Batches)
			return nil
		},
	}
	cmd.Flags().StringVar(&db, "db", "", "application database URL (default $"+envDB+")")
	cmd.Flags().StringVar(&table, "table", dedup.DefaultTable, "duplicate-detection table")
	cmd.Flags().IntVar(&batch, "batch-size", dedup.DefaultPurgeBatchSize, "keys deleted per statement")
	cmd.Flags().IntVar(&maxBatches, "max-batches", 0, "stop after this many batches (0: until no expired key is left)")
	return cmd
}
