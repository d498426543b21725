package main

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// requireNoFiles fails t if dir holds any file: a command that must not create state did.
func requireNoFiles(t *testing.T, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	require.Empty(t, names, "files created in %s", dir)
}

func TestReadOnlyCommands_MissingSQLiteFileIsReportedAndNotCreated(t *testing.T) {
	dir := t.TempDir()
	typo := filepath.Join(dir, "typo.db")

	_, err := run(t, "dlq", "list", "--broker", "sqlite://"+typo)
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.ErrorContains(t, err, "no such queue: "+typo)
	require.Equal(t, exitFailure, exitCode(err))
	for _, args := range [][]string{{"replay", "--all"}, {"delete", "--all", "--yes"}} {
		_, err = run(t, append([]string{"dlq"}, append(args, "--broker", "sqlite://"+typo)...)...)
		require.ErrorContains(t, err, "no such queue: "+typo, "%v", args)
	}

	_, err = run(t, "purge", "--db", "sqlite://"+typo)
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.ErrorContains(t, err, "no such database: "+typo+" (create it with onceflow migrate --db sqlite://"+typo+")")
	requireNoFiles(t, dir)
}

func TestPurge_MissingTableSaysToRunMigrate(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			url := d.URL(t)
			db, err := sqldb.Open(context.Background(), url) // the database exists, the tables do not
			require.NoError(t, err)
			defer db.Close()

			_, err = run(t, "purge", "--db", url)
			require.ErrorContains(t, err, "no duplicate-detection table onceflow_dedup in ")
			require.ErrorContains(t, err, ": create it with onceflow migrate")
			require.Equal(t, exitFailure, exitCode(err))

			_, err = run(t, "migrate", "--db", url)
			require.NoError(t, err)
			_, err = run(t, "purge", "--db", url, "--outbox")
			require.ErrorContains(t, err, "create it with onceflow migrate --outbox")
			_, err = run(t, "purge", "--db", url, "--deliveries")
			require.ErrorContains(t, err, "create it with onceflow migrate --deliveries")
		})
	}
}

func TestMigrateAll_ThenPurgeAllCoversEveryTable(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			url := d.URL(t)
			out, err := run(t, "migrate", "--db", url, "--all")
			require.NoError(t, err)
			for _, want := range []string{
				"dedup table onceflow_dedup\n",
				"delivery counter table onceflow_deliveries\n",
				"outbox onceflow_outbox, tables ",
				"ordering tables onceflow_order_state, onceflow_order_parked, onceflow_order_skipped, sequence table onceflow_order_seq\n",
			} {
				require.Contains(t, out, want)
			}

			db, err := sqldb.Open(context.Background(), url)
			require.NoError(t, err)
			defer db.Close()
			store, err := dedup.New(db, dedup.Config{Retention: time.Hour, Now: func() time.Time { return time.Now().Add(-2 * time.Hour) }})
			require.NoError(t, err)
			tx, err := db.Beginx()
			require.NoError(t, err)
			fresh, err := store.Record(context.Background(), tx, dedup.Key{Handler: "h", MessageID: "old"}, "")
			require.NoError(t, err)
			require.True(t, fresh)
			require.NoError(t, tx.Commit())

			out, err = run(t, "purge", "--db", url, "--all")
			require.NoError(t, err)
			require.Equal(t, strings.Join([]string{
				"purged 1 expired key from onceflow_dedup in 1 batch",
				"purged 0 expired delivery counts from onceflow_deliveries in 1 batch",
				"purged 0 sent messages from outbox onceflow_outbox in 1 batch",
			}, "\n")+"\n", out)
		})
	}
}

func TestDBURL_FlagThenOnceflowDBThenDatabaseURL(t *testing.T) {
	t.Setenv(envDB, "")
	t.Setenv(envDatabase, "sqlite:///from/database_url.db")
	got, err := dbURL("")
	require.NoError(t, err)
	require.Equal(t, "sqlite:///from/database_url.db", got)
	t.Setenv(envDB, "sqlite:///from/onceflow_db.db")
	got, err = dbURL("")
	require.NoError(t, err)
	require.Equal(t, "sqlite:///from/onceflow_db.db", got)
	got, err = dbURL("sqlite:///from/flag.db")
	require.NoError(t, err)
	require.Equal(t, "sqlite:///from/flag.db", got)

	// And a command reads it.
	t.Setenv(envDB, "")
	url := testsvc.SQLiteURL(t)
	t.Setenv(envDatabase, url)
	out, err := run(t, "migrate")
	require.NoError(t, err)
	require.Contains(t, out, "migrated sqlite://")
}

func TestCommands_UsageErrorsExitWith2(t *testing.T) {
	t.Setenv(envDB, "")
	t.Setenv(envDatabase, "")
	t.Setenv(envBroker, "")
	queue := "sqlite://" + filepath.Join(t.TempDir(), "queue.db")
	for _, args := range [][]string{
		{"no-such-command"},
		{"migrate", "--no-such-flag"},
		{"migrate", "extra-argument"},
		{"migrate"}, // no database
		{"purge", "--batch-size", "x"},
		{"purge", "--db", "sqlite:///x.db", "--batch-size", "-1"},
		{"dlq", "list"}, // no broker
		{"dlq", "list", "--broker", queue, "--limit", "0"},
		{"dlq", "replay", "--broker", queue},
		{"dlq", "replay", "--broker", queue, "--reason", ""},
	} {
		_, err := run(t, args...)
		require.Error(t, err, "%v", args)
		require.Equal(t, exitUsage, exitCode(err), "%v: %v", args, err)
	}
	_, err := run(t, "migrate", "--db", "postgres://app@127.0.0.1:1/none?connect_timeout=1")
	require.Error(t, err)
	require.Equal(t, exitFailure, exitCode(err), "a database that cannot be reached is not a usage error")
}

func TestPurge_TableFlagIsTheDeprecatedNameOfDedupTable(t *testing.T) {
	url := testsvc.SQLiteURL(t)
	_, err := run(t, "migrate", "--db", url, "--dedup-table", "keys")
	require.NoError(t, err)
	out, err := run(t, "purge", "--db", url, "--table", "keys")
	require.NoError(t, err)
	require.Contains(t, out, "Flag --table has been deprecated, use --dedup-table, as migrate does")
	require.Contains(t, out, "purged 0 expired keys from keys in 1 batch\n")
}

func TestPurge_TrimsTheAcknowledgedMessagesOfAQueue(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	dbURL, queueURL := "sqlite://"+filepath.Join(dir, "app.db"), "sqlite://"+filepath.Join(dir, "queue.db")
	_, err := run(t, "migrate", "--db", dbURL)
	require.NoError(t, err)

	b, err := broker.Open(ctx, queueURL, broker.Options{ConsumerGroup: "billing"})
	require.NoError(t, err)
	for i := range 5 {
		require.NoError(t, b.Publisher().Publish("orders", message.NewMessage(fmt.Sprintf("m-%d", i), []byte("x"))))
	}
	sub, err := b.Subscriber()
	require.NoError(t, err)
	subCtx, stop := context.WithCancel(ctx)
	msgs, err := sub.Subscribe(subCtx, "orders")
	require.NoError(t, err)
	for range 3 { // the group acknowledges the first three
		select {
		case m := <-msgs:
			m.Ack()
		case <-time.After(10 * time.Second):
			t.Fatal("no message within 10 s")
		}
	}
	stop()
	require.NoError(t, sub.Close()) // commits the acknowledgements and gives the rest back
	require.NoError(t, b.Close())

	out, err := run(t, "purge", "--db", dbURL, "--queue", queueURL, "--topic", "orders")
	require.NoError(t, err)
	require.Contains(t, out, "trimmed 3 acknowledged messages from topic orders of "+queueURL+"\n")
	out, err = run(t, "purge", "--db", dbURL, "--queue", queueURL, "--topic", "orders")
	require.NoError(t, err)
	require.Contains(t, out, "trimmed 0 acknowledged messages from topic orders")

	// A mistyped topic is reported, and the command fails.
	_, err = run(t, "purge", "--db", dbURL, "--queue", queueURL, "--topic", "order")
	require.ErrorIs(t, err, broker.ErrNotFound)
	require.ErrorContains(t, err, `topic "order" does not exist`)
	require.Equal(t, exitFailure, exitCode(err))

	_, err = run(t, "purge", "--db", dbURL, "--topic", "orders")
	require.ErrorContains(t, err, "--queue and --topic go together")
	require.Equal(t, exitUsage, exitCode(err))
	_, err = run(t, "purge", "--db", dbURL, "--queue", queueURL)
	require.ErrorContains(t, err, "--queue and --topic go together")
}
