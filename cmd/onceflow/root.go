package main

import (
	"errors"
	"os"

	"github.com/spf13/cobra"
)

// envDB names the environment variable that supplies --db when the flag is absent.
const envDB = "ONCEFLOW_DB"

// exitError carries a process exit status other than 1.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func exitCode(err error) int {
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	return 1
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
	root.AddCommand(newVersionCommand(), newMigrateCommand(), newPurgeCommand(), newVerifyCommand(), newVerifyConsumerCommand(), newDLQCommand())
	return root
}

// dbURL returns the --db flag, or $ONCEFLOW_DB when the flag is empty.
func dbURL(flag string) (string, error) {
	if flag != "" {
		return flag, nil
	}
	if v := os.Getenv(envDB); v != "" {
		return v, nil
	}
	return "", errors.New("no database: pass --db URL or set " + envDB + " (postgres://, mysql:// or sqlite://)")
}
