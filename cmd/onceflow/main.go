// Command onceflow is the operations tool of the onceflow framework: it creates the tables
// onceflow needs, purges expired duplicate-detection keys, lists and replays dead letters, and
// measures lost and duplicated effects under injected crashes (verify).
//
// Every command takes its database and broker as URLs (see docs/configuration.md): --db, else
// $ONCEFLOW_DB, else $DATABASE_URL; --broker, else $ONCEFLOW_BROKER. Passwords in URLs are
// never printed. The exit status is 0 when the command did its work, 1 when it could not, 2 on
// a usage error (nothing was done), and 3 when verify measured a broken guarantee.
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
	err := execute(ctx, newRootCommand())
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "onceflow:", err)
		os.Exit(exitCode(err))
	}
}
