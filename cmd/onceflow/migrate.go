package main

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/sqldb"
)

// tableFlags are the table names and the choice of tables that migrate and purge take.
type tableFlags struct {
	db                                            string
	dedupTable, outboxTable, deliveriesTable      string
	orderTable, seqTable                          string
	withOutbox, withDeliveries, withOrdering, all bool
}

// register adds the flags; ordering says whether the command handles the ordering tables.
func (f *tableFlags) register(cmd *cobra.Command, orderingFlags bool) {
	fl := cmd.Flags()
	fl.StringVar(&f.db, "db", "", "application database URL (default $"+envDB+", then $"+envDatabase+")")
	fl.StringVar(&f.dedupTable, "dedup-table", dedup.DefaultTable, "duplicate-detection table")
	fl.BoolVar(&f.withOutbox, "outbox", false, "also the outbox's tables")
	fl.StringVar(&f.outboxTable, "outbox-table", outbox.DefaultTable, "the outbox (with --outbox)")
	fl.BoolVar(&f.withDeliveries, "deliveries", false, "also the delivery counter table, kept for brokers that do not count deliveries")
	fl.StringVar(&f.deliveriesTable, "deliveries-table", dedup.DefaultCounterTable, "delivery counter table (with --deliveries)")
	if orderingFlags {
		fl.BoolVar(&f.withOrdering, "ordering", false, "also the ExactlyOnceInOrder tables and the producers' sequence table")
		fl.StringVar(&f.orderTable, "order-table", ordering.DefaultTable, "prefix of the ordering tables (with --ordering)")
		fl.StringVar(&f.seqTable, "sequence-table", ordering.DefaultSequenceTable, "producers' sequence table (with --ordering)")
		fl.BoolVar(&f.all, "all", false, "every table onceflow may use: --outbox --deliveries --ordering")
	} else {
		fl.BoolVar(&f.all, "all", false, "every table that has something to purge: --outbox --deliveries")
	}
}

// resolve applies --all and returns the database URL.
func (f *tableFlags) resolve() (string, error) {
	if f.all {
		f.withOutbox, f.withDeliveries, f.withOrdering = true, true, true
	}
	return dbURL(f.db)
}

func newMigrateCommand() *cobra.Command {
	var f tableFlags
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create the tables onceflow needs, if missing",
		Long: `Creates the duplicate-detection table in the application database; with --outbox the outbox's
tables, with --deliveries the delivery counter table (for brokers that do not count deliveries,
such as RabbitMQ classic queues), with --ordering the tables of ExactlyOnceInOrder handlers (their
ordering state and parked messages) and of producers numbering messages with
ordering.Sequencer; --all creates them all. An SQLite database file is created if missing.

It is idempotent and safe to run from several nodes at once. The router, the outbox and the
relays create the tables they use when they start unless configured not to: run migrate where
the application's database user may not create tables.`,
		Example: `  onceflow migrate --db sqlite://var/app.db --all
  DATABASE_URL=postgres://app@db:5432/app onceflow migrate --outbox`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			url, err := f.resolve()
			if err != nil {
				return err
			}
			ctx, out := cmd.Context(), cmd.OutOrStdout()
			conn, err := sqldb.Open(ctx, url)
			if err != nil {
				return err
			}
			defer conn.Close()
			migrate := func(m func(context.Context) error) error {
				if err := m(ctx); err != nil {
					return fmt.Errorf("migrate %s: %w", conn, err)
				}
				return nil
			}

			store, err := dedup.New(conn, dedup.Config{Table: f.dedupTable})
			if err != nil {
				return usageError(err)
			}
			if err := migrate(store.Migrate); err != nil {
				return err
			}
			fmt.Fprintf(out, "migrated %s: dedup table %s\n", conn, store.Table())

			if f.withDeliveries {
				counter, err := dedup.NewCounter(conn, dedup.CounterConfig{Table: f.deliveriesTable})
				if err != nil {
					return usageError(err)
				}
				if err := migrate(counter.Migrate); err != nil {
					return err
				}
				fmt.Fprintf(out, "migrated %s: delivery counter table %s\n", conn, counter.Table())
			}
			if f.withOutbox {
				ob, err := outbox.New(conn, outbox.Config{Table: f.outboxTable})
				if err != nil {
					return usageError(err)
				}
				if err := migrate(ob.Migrate); err != nil {
					return err
				}
				messages, offsets := ob.Tables()
				fmt.Fprintf(out, "migrated %s: outbox %s, tables %s, %s and its leases\n", conn, ob.Table(), messages, offsets)
			}
			if f.withOrdering {
				order, err := ordering.NewStore(conn, ordering.StoreConfig{Table: f.orderTable})
				if err != nil {
					return usageError(err)
				}
				seq, err := ordering.NewSequencer(conn, ordering.SequencerConfig{Table: f.seqTable})
				if err != nil {
					return usageError(err)
				}
				for _, m := range []func(context.Context) error{order.Migrate, seq.Migrate} {
					if err := migrate(m); err != nil {
						return err
					}
				}
				state, parked, skipped := order.Tables()
				fmt.Fprintf(out, "migrated %s: ordering tables %s, %s, %s, sequence table %s\n", conn, state, parked, skipped, seq.Table())
			}
			return nil
		},
	}
	f.register(cmd, true)
	return cmd
}
