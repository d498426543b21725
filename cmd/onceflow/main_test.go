package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// run executes the command line args in process, with an empty standard input, and returns
// its standard output and error.
func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	return runWithInput(t, strings.NewReader(""), args...)
}

// runWithInput is run with stdin as the standard input.
func runWithInput(t *testing.T, stdin io.Reader, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetIn(stdin)
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := execute(context.Background(), cmd)
	return out.String(), err
}

func TestMigrateThenPurge_RemovesOnlyExpiredKeys(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			url := d.URL(t)
			out, err := run(t, "migrate", "--db", url)
			require.NoError(t, err)
			require.Contains(t, out, "dedup table onceflow_dedup")
			_, err = run(t, "migrate", "--db", url)
			require.NoError(t, err, "migrate is idempotent")

			db, err := sqldb.Open(context.Background(), url)
			require.NoError(t, err)
			defer db.Close()
			record := func(now time.Time, ids ...string) {
				store, err := dedup.New(db, dedup.Config{Retention: time.Hour, Now: func() time.Time { return now }})
				require.NoError(t, err)
				tx, err := db.Beginx()
				require.NoError(t, err)
				for _, id := range ids {
					fresh, err := store.Record(context.Background(), tx, dedup.Key{Handler: "h", MessageID: id}, "")
					require.NoError(t, err)
					require.True(t, fresh)
				}
				require.NoError(t, tx.Commit())
			}
			record(time.Now().Add(-2*time.Hour), "old-1", "old-2", "old-3")
			record(time.Now(), "new-1")

			out, err = run(t, "purge", "--db", url, "--batch-size", "2")
			require.NoError(t, err)
			require.Equal(t, "purged 3 expired keys from onceflow_dedup in 2 batches\n", out)

			var ids []string
			require.NoError(t, db.Select(&ids, `SELECT message_id FROM onceflow_dedup`))
			require.Equal(t, []string{"new-1"}, ids)
		})
	}
}

func TestCommands_WithoutDatabaseSayWhatIsMissing(t *testing.T) {
	t.Setenv(envDB, "")
	_, err := run(t, "purge")
	require.ErrorContains(t, err, "pass --db URL or set ONCEFLOW_DB")
}

func TestCommands_NeverPrintThePassword(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, db, broker string }{
		{"URL", "postgres://app:s3cr3t-pw@127.0.0.1:1/none?sslmode=disable&connect_timeout=1", "amqp://app:s3cr3t-pw@127.0.0.1:1/"},
		{"keywords", "host=127.0.0.1 port=1 user=app password=s3cr3t-pw dbname=none", "host=127.0.0.1 port=1 password=s3cr3t-pw"},
		{"quoted keywords", "host=127.0.0.1 password='s3cr3t-pw and more' dbname=none", "host=127.0.0.1 password='s3cr3t-pw and more'"},
		{"DSN", "app:s3cr3t-pw@tcp(127.0.0.1:1)/none", "app:s3cr3t-pw@tcp(127.0.0.1:1)/none"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for _, args := range [][]string{
				{"migrate", "--db", tc.db},
				{"purge", "--db", tc.db},
				{"verify", "--db", tc.db, "--messages", "1"},
				{"dlq", "list", "--broker", tc.broker},
				{"dlq", "replay", "--broker", tc.broker, "--all"},
			} {
				out, err := run(t, args...)
				require.Error(t, err, "%v", args)
				require.NotContains(t, err.Error(), "s3cr3t", "%v", args)
				require.NotContains(t, out, "s3cr3t", "%v", args)
			}
		})
	}
}
