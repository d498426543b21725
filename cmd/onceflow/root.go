package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// The environment variables that supply --db when the flag is absent, in the order they are
// read: onceflow's own, then the one most platforms set for an application's database.
const (
	envDB         = "ONCEFLOW_DB"
	envDatabase   = "DATABASE_URL"
	dbSchemesHint = "postgres://, mysql:// or sqlite://"
)

// The exit statuses of the command (documented in docs/operations.md).
const (
	// exitFailure: the command could not do its work (a database that cannot be reached, a
	// table that is missing, ...).
	exitFailure = 1
	// exitUsage: the command line is wrong (an unknown command or flag, a missing URL, a value
	// out of range); nothing was done.
	exitUsage = 2
	// exitViolation: verify ran and measured a lost, duplicated or out-of-order effect.
	exitViolation = 3
)

// exitError carries a process exit status other than exitFailure.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// usageError marks err as a mistake in the command line.
func usageError(err error) error { return &exitError{code: exitUsage, err: err} }

// usagef is usageError of a formatted error.
func usagef(format string, args ...any) error { return usageError(fmt.Errorf(format, args...)) }

func exitCode(err error) int {
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	return exitFailure
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "onceflow",
		Short:         "Operate and verify exactly-once message processing",
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version(),
	}
	root.SetVersionTemplate("onceflow {{.Version}}\n")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError(err) })
	root.AddCommand(newVersionCommand(), newMigrateCommand(), newPurgeCommand(), newVerifyCommand(), newVerifyConsumerCommand(), newDLQCommand(), newConsoleCommand())
	return root
}

// execute runs root with ctx. An error met before a command starts its work (an unknown
// command, a bad flag, wrong arguments) is a usage error.
func execute(ctx context.Context, root *cobra.Command) error {
	started := false
	root.PersistentPreRun = func(*cobra.Command, []string) { started = true }
	err := root.ExecuteContext(ctx)
	if err != nil && !started && exitCode(err) == exitFailure {
		return usageError(err)
	}
	return err
}

// dbURL returns the --db flag, else $ONCEFLOW_DB, else $DATABASE_URL.
func dbURL(flag string) (string, error) {
	for _, v := range []string{flag, os.Getenv(envDB), os.Getenv(envDatabase)} {
		if v != "" {
			return v, nil
		}
	}
	return "", usagef("no database: pass --db URL or set %s or %s (%s)", envDB, envDatabase, dbSchemesHint)
}
