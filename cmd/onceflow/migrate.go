package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/sqldb"
)

func newMigrateCommand() *cobra.Command {
	var db, dedupTable string
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create the tables onceflow needs, if missing",
		Long: `Creates the duplicate-detection table in the application database. It is idempotent
and safe to run from several nodes at once. The router runs the same migration at start unless
it is configured not to.`,
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
			return nil
		},
	}
	cmd.Flags().StringVar(&db, "db", "", "application database URL (default $"+envDB+")")
	cmd.Flags().StringVar(&dedupTable, "dedup-table", dedup.DefaultTable, "duplicate-detection table")
	return cmd
}
