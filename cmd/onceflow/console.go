package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/sqldb"
)

// defaultListen is where onceflow console listens unless --listen says otherwise: loopback,
// so that the console is not on the network by accident.
const defaultListen = "127.0.0.1:8080"

func newConsoleCommand() *cobra.Command {
	var (
		brokerFlag, group, topic, dbFlag, listen, title string
		dedupTable, deliveriesTable, outboxTable        string
		outboxGroup                                     string
		scanLimit                                       int
		allowChanges                                    bool
	)
	cmd := &cobra.Command{
		Use:   "console",
		Short: "Serve the operator's console: handlers, dead letters and storage in a browser",
		Long: `Serves the console (package console) over the database and the broker of a onceflow service, from
beside it: the handlers the database knows (each one's topic, messages applied per second, the
last one applied, redelivered and dead-lettered messages), the dead letters waiting in the
dead-letter topic for the consumer group (searched, opened, replayed and deleted as with
onceflow dlq), and the storage (the dedup table, the outbox, the last purge). A service that
mounts the console itself shows more: each handler's state, deliveries in flight and outcomes
(docs/console.md).

It is read-only unless --allow-changes is given: then anyone who reaches --listen may replay
and delete dead letters. It listens on loopback by default; on another address, put it behind
a proxy that authenticates. Changes are logged on standard error. It runs until interrupted.

Give --broker, --db or both (their environment variables count); a queue file or database that
does not exist is reported, not created.`,
		Example: `  onceflow console --broker 'amqp://guest:guest@127.0.0.1:5672/?group=billing' --db 'postgres://app@db:5432/app'
  onceflow console --broker sqlite://var/queue.db --db sqlite://var/app.db --listen 127.0.0.1:9000 --allow-changes`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if scanLimit < 0 {
				return usagef("--scan-limit %d: want 0 (the default) or more", scanLimit)
			}
			cfg := console.Config{DeadLetterTopic: topic, ScanLimit: scanLimit, Title: title, DedupTable: dedupTable,
				DeliveriesTable: deliveriesTable, OutboxTable: outboxTable, OutboxGroup: outboxGroup,
				Logger: slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))}
			if allowChanges {
				cfg.Authorize = func(*http.Request) error { return nil }
			}
			dbRaw := dbFlag
			if dbRaw == "" {
				dbRaw, _ = dbURL("") // the environment's, if any: the database is optional
			}
			brokerRaw := brokerFlag
			if brokerRaw == "" {
				brokerRaw = os.Getenv(envBroker)
			}
			if dbRaw == "" && brokerRaw == "" {
				return usagef("nothing to show: pass --broker URL, --db URL or both (or set %s, %s)", envBroker, envDB)
			}
			if brokerRaw != "" {
				rawURL, err := brokerURL(brokerRaw, group)
				if err != nil {
					return err
				}
				b, err := broker.Open(ctx, rawURL, broker.Options{MustExist: true})
				if err != nil {
					return err
				}
				defer b.Close()
				cfg.Broker = b
			}
			if dbRaw != "" {
				db, err := sqldb.OpenExisting(ctx, dbRaw)
				if err != nil {
					return withMigrateHint(err, dbRaw)
				}
				defer db.Close()
				cfg.DB = db
			}
			c, err := console.New(cfg)
			if err != nil {
				return usageError(err)
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return usagef("--listen %s: %w", listen, err)
			}
			mode := "read-only: --allow-changes allows replays and deletes"
			if allowChanges {
				mode = "changes allowed"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "onceflow console on http://%s/ (%s); Ctrl-C stops it\n", ln.Addr(), mode)
			if ip, ok := ln.Addr().(*net.TCPAddr); ok && !ip.IP.IsLoopback() {
				what := "sees the dead letters' payloads"
				if allowChanges {
					what += ", and may replay and delete them"
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "onceflow console: %s is not a loopback address: anyone who reaches it %s\n", ln.Addr(), what)
			}
			return serve(ctx, ln, c)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&brokerFlag, "broker", "", "broker URL of the dead-letter topic (default $"+envBroker+")")
	fl.StringVar(&group, "group", "", `consumer group whose dead letters to show (default: the URL's group= parameter, else "`+broker.DefaultConsumerGroup+`")`)
	fl.StringVar(&topic, "topic", onceflow.DefaultDeadLetterTopic, "dead-letter topic")
	fl.StringVar(&dbFlag, "db", "", "application database URL (default $"+envDB+", then $"+envDatabase+")")
	fl.StringVar(&dedupTable, "dedup-table", dedup.DefaultTable, "duplicate-detection table")
	fl.StringVar(&deliveriesTable, "deliveries-table", dedup.DefaultCounterTable, "delivery counter table")
	fl.StringVar(&outboxTable, "outbox-table", outbox.DefaultTable, "the outbox")
	fl.StringVar(&outboxGroup, "outbox-group", outbox.DefaultConsumerGroup, "consumer group of the outbox relays whose backlog to show")
	fl.StringVar(&listen, "listen", defaultListen, "address to serve the console on")
	fl.BoolVar(&allowChanges, "allow-changes", false, "allow replaying and deleting dead letters from the console")
	fl.IntVar(&scanLimit, "scan-limit", console.DefaultScanLimit, "how many waiting dead letters a page, a search or a replay of all that match looks at")
	fl.StringVar(&title, "title", "onceflow", "name of the service, in the page's header")
	return cmd
}

// serve serves c on ln until ctx ends, then lets the requests in progress finish for a while.
func serve(ctx context.Context, ln net.Listener, c http.Handler) error {
	srv := &http.Server{Handler: c, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		return err
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
