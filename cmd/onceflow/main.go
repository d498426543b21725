// Command onceflow is the operations tool of the onceflow framework: it creates the tables
// onceflow needs, purges expired duplicate-detection keys, lists and replays dead letters, and
// measures lost and duplicated effects under injected crashes (verify).
//
// Every command takes its database and broker as URLs (see docs/configuration.md); passwords
// in URLs are never printed.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	// The command opens any broker URL and any database URL.
	_ "github.com/onceflow/onceflow/broker/all"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "onceflow:", err)
		os.Exit(exitCode(err))
	}
}
