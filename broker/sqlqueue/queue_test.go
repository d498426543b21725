package sqlqueue_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

func TestConfig_ValidateNamesTheField(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  sqlqueue.Config
		want string
	}{
		{sqlqueue.Config{Prefetch: -1}, "Config.Prefetch: -1"},
		{sqlqueue.Config{Prefetch: sqlqueue.MaxPrefetch + 1}, "Config.Prefetch: 10001"},
		{sqlqueue.Config{AckTimeout: -time.Second}, "Config.AckTimeout: -1s"},
		{sqlqueue.Config{NackDelay: -time.Second}, "Config.NackDelay: -1s"},
		{sqlqueue.Config{CloseTimeout: -time.Second}, "Config.CloseTimeout: -1s"},
		{sqlqueue.Config{ConsumerGroup: strings.Repeat("g", 256)}, "Config.ConsumerGroup: 256 bytes"},
	} {
		require.ErrorContains(t, tc.cfg.Validate(), tc.want)
	}
	require.NoError(t, sqlqueue.Config{}.Validate())
}

func TestNew_RejectsSQLite(t *testing.T) {
	t.Parallel()
	db := openDB(t, "sqlite://"+t.TempDir()+"/q.db")
	_, err := sqlqueue.New(db.DB.DB, sqldb.SQLite, sqlqueue.Config{})
	require.ErrorContains(t, err, `dialect "sqlite"`)
}

func TestCheckTopic_EveryTableNameFits(t *testing.T) {
	t.Parallel()
	// "watermill_offsets_<topic>", the longest name, within PostgreSQL's 63 bytes: the limit
	// that the queue had before leases.
	require.Equal(t, 45, sqlqueue.MaxTopic)
	require.NoError(t, sqlqueue.CheckTopic(strings.Repeat("a", sqlqueue.MaxTopic)))
	require.ErrorContains(t, sqlqueue.CheckTopic(strings.Repeat("a", sqlqueue.MaxTopic+1)), "at most 45 bytes")
	require.ErrorContains(t, sqlqueue.CheckTopic(`a"b`), "only letters, digits and - $ : . _")
	require.NoError(t, sqlqueue.CheckTopic("orders.created:v1-$x_y"))
}

// Two topics of the longest length that differ in their last byte have tables and indexes of
// their own: no name is truncated.
func TestQueue_LongestTopicsKeepTheirOwnTables(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{})
		prefix := topic()
		prefix += strings.Repeat("x", sqlqueue.MaxTopic-1-len(prefix))
		for _, tp := range []string{prefix + "1", prefix + "2"} {
			id := e.publish(q, tp, tp[len(tp)-1:], 1)[0]
			_, ch := e.subscribe(q, tp)
			m := receive(t, ch)
			require.Equal(t, id, m.UUID)
			ack(m)
			testsvc.RequireNothing(t, ch, 100*time.Millisecond)
		}
		if e.dialect == "postgres" {
			var n int
			require.NoError(t, e.db.Get(&n, `SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND indexname LIKE 'onceflow_due_%'`))
			require.Equal(t, 2, n)
		}
	})
}

// A row written by a producer other than watermill-sql is delivered whatever its metadata.
func TestSubscriber_ForeignMetadataIsDeliveredAsStrings(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		q := e.queue(sqlqueue.Config{})
		tp := topic()
		require.NoError(t, q.EnsureTopic(context.Background(), tp))
		insert := "INSERT INTO " + e.messagesTable(tp) + " (uuid, payload, metadata) VALUES (?, ?, ?)"
		if e.dialect == "postgres" {
			insert = "INSERT INTO " + e.messagesTable(tp) + " (uuid, payload, metadata, transaction_id) VALUES ($1, $2, $3, pg_current_xact_id())"
		}
		for _, r := range [][]any{
			{"typed", []byte("p"), `{"s": "x", "n": 1, "b": true, "z": null, "o": {"k": [1, 2]}}`},
			{"array", nil, `[1, 2]`},
			{"none", []byte("q"), nil},
		} {
			_, err := e.db.Exec(insert, r...)
			require.NoError(t, err)
		}
		_, ch := e.subscribe(q, tp)
		typed := receive(t, ch)
		require.Equal(t, "typed", typed.UUID)
		require.Equal(t, "p", string(typed.Payload))
		require.Equal(t, map[string]string{"s": "x", "n": "1", "b": "true", "z": "", "o": `{"k": [1, 2]}`}, map[string]string(typed.Metadata))
		array := receive(t, ch)
		require.Equal(t, "array", array.UUID)
		require.Empty(t, array.Payload)
		require.Equal(t, `[1, 2]`, array.Metadata.Get(sqlqueue.HeaderMetadata))
		none := receive(t, ch)
		require.Equal(t, "none", none.UUID)
		require.Empty(t, none.Metadata)
		for _, m := range []*message.Message{typed, array, none} {
			ack(m)
		}
	})
}

// A queue whose tables are named by Config.Tables keeps its messages, cursor and leases there,
// and a topic longer than MaxTopic is only a key.
func TestQueue_TablesNamedByConfig(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		base := topic()
		names := func(tp string) sqlqueue.Tables {
			return sqlqueue.Tables{Messages: base + "_m", Offsets: base + "_o", Leases: base + "_l", DueIndex: base + "_d"}
		}
		cfg := sqlqueue.Config{Tables: names}
		q := e.queue(cfg)
		long := strings.Repeat("k", sqlqueue.MaxTopic+10)
		require.NoError(t, q.CreateTables(ctx, long))
		var groups int
		require.NoError(t, e.db.Get(&groups, `SELECT COUNT(*) FROM `+e.quote(base+"_o")))
		require.Zero(t, groups, "CreateTables registers no consumer group")

		id := e.publish(q, long, "m", 1)[0]
		_, ch := e.subscribe(q, long)
		m := receive(t, ch)
		require.Equal(t, id, m.UUID)
		var leases int
		require.NoError(t, e.db.Get(&leases, `SELECT COUNT(*) FROM `+e.quote(base+"_l")))
		require.Equal(t, 1, leases)
		ack(m)

		bad := sqlqueue.Config{Tables: func(string) sqlqueue.Tables {
			return sqlqueue.Tables{Messages: `a"b`, Offsets: "o", Leases: "l", DueIndex: "d"}
		}}
		require.ErrorContains(t, e.queue(bad).CreateTables(ctx, "x"), `table name Messages "a\"b"`)
	})
}

// An idle subscription that is woken claims at once, not at its next poll.
func TestQueue_WakeMakesAnIdleSubscriptionClaimAtOnce(t *testing.T) {
	t.Parallel()
	forEachDatabase(t, func(t *testing.T, e *env) {
		tp := topic()
		q := e.queue(sqlqueue.Config{PollInterval: time.Hour})
		_, ch := e.subscribe(q, tp)
		// Let the subscription's first claim find nothing and go to sleep.
		testsvc.RequireNothing(t, ch, 200*time.Millisecond)
		id := e.publish(q, tp, "m", 1)[0]
		testsvc.RequireNothing(t, ch, 200*time.Millisecond)
		m := wakeUntilClaimed(t, q, tp, ch)
		require.Equal(t, id, m.UUID)
		ack(m)
	})
}

// On PostgreSQL a message comes into view only once every transaction that began before its
// own has ended: a Wake before then finds nothing, and a Wake after claims it.
func TestQueue_PostgresWakeFindsAMessageOnceTheOlderTransactionsEnd(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "postgres", testsvc.PostgresSchemaURL(t))
	e.direct = true
	tp := topic()
	q := e.queue(sqlqueue.Config{PollInterval: time.Hour})
	_, ch := e.subscribe(q, tp)
	testsvc.RequireNothing(t, ch, 200*time.Millisecond)

	older, err := e.db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	defer func() { _ = older.Rollback() }()
	_, err = older.Exec(`SELECT pg_current_xact_id()`) // takes a transaction id
	require.NoError(t, err)
	id := e.publish(q, tp, "m", 1)[0]
	q.Wake(tp)
	testsvc.RequireNothing(t, ch, 300*time.Millisecond)

	require.NoError(t, older.Rollback())
	m := wakeUntilClaimed(t, q, tp, ch)
	require.Equal(t, id, m.UUID)
	ack(m)
}

// wakeUntilClaimed wakes the subscriptions of tp until a message comes on ch, and returns it.
// On PostgreSQL a new message waits for every transaction that began before its own to end,
// and the parallel tests hold some open: one Wake may come too early. The test fails when
// nothing comes within 10 seconds.
func wakeUntilClaimed(t *testing.T, q *sqlqueue.Queue, tp string, ch <-chan *message.Message) *message.Message {
	t.Helper()
	deadline := time.After(10 * time.Second)
	again := time.NewTicker(50 * time.Millisecond)
	defer again.Stop()
	for {
		q.Wake(tp)
		select {
		case m := <-ch:
			return m
		case <-again.C:
		case <-deadline:
			t.Fatal("the woken subscription did not claim the message")
			return nil
		}
	}
}

// Consumer processes that start at once each create the tables of their topic: on PostgreSQL,
// concurrent CREATE TABLE IF NOT EXISTS of one table fail with duplicate_object or
// duplicate_table, besides unique_violation, when another one wins.
func TestEnsureTopic_ConcurrentQueuesCreateTheTablesOnce(t *testing.T) {
	forEachDatabase(t, func(t *testing.T, e *env) {
		for round := range 5 {
			topic := fmt.Sprintf("race_%d_%d", time.Now().UnixNano(), round)
			errs := make(chan error, 8)
			for range cap(errs) {
				go func() {
					q, err := sqlqueue.New(e.db.DB.DB, e.db.Dialect, fast)
					if err == nil {
						err = q.EnsureTopic(context.Background(), topic)
					}
					errs <- err
				}()
			}
			for range cap(errs) {
				require.NoError(t, <-errs, "round %d", round)
			}
		}
	})
}
