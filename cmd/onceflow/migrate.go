package main

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/sqldb"
)

func newMigrateCommand() *cobra.Command {
	var db, dedupTable, orderTable, seqTable string
	var withOrdering bool
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create the tables onceflow needs, if missing",
		Long: `Creates the duplicate-detection table in the application database, and with --ordering
the tables of ExactlyOnceInOrder handlers (their ordering state and parked messages) and of
producers numbering messages with ordering.Sequencer. It is idempotent and safe to run from
several nodes at once. The router runs the same migration at start unless it is configured not
to.`,
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
			store, err := dedup.New(conn, dedup.Config{Table: dedupTable})
			if err != nil {
				return err
			}
			if err := store.Migrate(cmd.Context()); err != nil {
				return fmt.Errorf("migrate %s: %w", conn, err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "migrated %s: dedup table %s\n", conn, store.Table())
			if !withOrdering {
				return nil
			}
			order, err := ordering.NewStore(conn, ordering.StoreConfig{Table: orderTable})
			if err != nil {
				return err
			}
			seq, err := ordering.NewSequencer(conn, ordering.SequencerConfig{Table: seqTable})
			if err != nil {
				return err
			}
			for _, migrate := range []func(context.Context) error{order.Migrate, seq.Migrate} {
				if err := migrate(cmd.Context()); err != nil {
					return fmt.Errorf("migrate %s: %w", conn, err)
				}
			}
			state, parked, skipped := order.Tables()
			fmt.Fprintf(cmd.OutOrStdout(), "migrated %s: ordering tables %s, %s, %s, sequence table %s\n", conn, state, parked, skipped, seq.Table())
			return nil
		},
	}
	cmd.Flags().StringVar(&db, "db", "", "application database URL (default $"+envDB+")")
	cmd.Flags().StringVar(&dedupTable, "dedup-table", dedup.DefaultTable, "duplicate-detection table")
	cmd.Flags().BoolVar(&withOrdering, "ordering", false, "also create the ExactlyOnceInOrder tables and the producers' sequence table")
	cmd.Flags().StringVar(&orderTable, "order-table", ordering.DefaultTable, "prefix of the ordering tables (with --ordering)")
	cmd.Flags().StringVar(&seqTable, "sequence-table", ordering.DefaultSequenceTable, "producers' sequence table (with --ordering)")
	return cmd
}
