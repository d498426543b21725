package main

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// TestExpert_AppliesEachMessageOnce runs each expert consumer at concurrency 4 over a topic
// holding 100 messages, five of which an earlier consumer committed and never acknowledged (it
// died between its commit and its ack, so the broker delivers them again), plus a second copy
// of one message. Every message must have exactly one business row, and every delivery must be
// acknowledged.
func TestExpert_AppliesEachMessageOnce(t *testing.T) {
	for _, st := range allSetups {
		t.Run(st.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dir := t.TempDir()
			dbURL, db, brokerURL := expertTestServices(t, st, dir)
			tables := newCellTables(newID())
			require.NoError(t, tables.create(ctx, db))
			tp := topic{st: st, brokerURL: brokerURL, name: "bench_test_" + newID()}
			require.NoError(t, tp.prepare(ctx))
			t.Cleanup(tp.remove)

			msgs := newMessages(100, []byte("payload"))
			x, err := openExpertSQL(ctx, dbURL, tables, 1)
			require.NoError(t, err)
			var committed []inMsg
			for _, m := range msgs[:5] {
				committed = append(committed, inMsg{id: m.UUID, payload: m.Payload})
			}
			fresh, err := x.apply(ctx, committed)
			require.NoError(t, err)
			require.Len(t, fresh, 5)
			require.NoError(t, x.close())

			again := message.NewMessage(msgs[7].UUID, msgs[7].Payload)
			again.Metadata.Set(broker.HeaderNATSMsgID, msgs[7].UUID+"-again") // not dropped by JetStream
			snd, err := newSender(ctx, tp)
			require.NoError(t, err)
			require.NoError(t, snd.send(ctx, msgs[:50]))
			require.NoError(t, snd.send(ctx, []*message.Message{again}))
			require.NoError(t, snd.send(ctx, msgs[50:]))
			require.NoError(t, snd.wait(ctx))
			require.NoError(t, snd.close())

			m := newMeter(0, 95)
			s := &suite{}
			stop, err := s.startConsumer(ctx, cell{st: st, variant: vExpert, c: 4, scenario: scenarioDrain}, tp, dbURL, db, tables, m)
			require.NoError(t, err)
			testsvc.Eventually(t, 30*time.Second, func() bool { return m.settled.Load() >= 101 }, "deliveries acknowledged: %d of 101", m.settled.Load())
			time.Sleep(50 * time.Millisecond) // room for a delivery too many
			require.NoError(t, stop())

			require.Equal(t, int64(95), m.n.Load(), "effects the expert wrote")
			require.Equal(t, int64(101), m.settled.Load(), "deliveries the expert acknowledged")
			rows, err := db.QueryxContext(ctx, `SELECT message_id, COUNT(*) FROM `+tables.effects+` GROUP BY message_id`)
			require.NoError(t, err)
			got := map[string]int{}
			for rows.Next() {
				var id string
				var n int
				require.NoError(t, rows.Scan(&id, &n))
				got[id] = n
			}
			require.NoError(t, rows.Err())
			want := map[string]int{}
			for _, m := range msgs {
				want[m.UUID] = 1
			}
			require.Equal(t, want, got)
		})
	}
}

// TestExpertSQL_AFailedBusinessInsertRecordsNoID fails the expert's business insert (a NULL
// payload in a NOT NULL column), which runs in the second round trip of the transaction: the
// ids recorded in the first must be rolled back with it, and the same connection must commit
// the batch when it comes again.
func TestExpertSQL_AFailedBusinessInsertRecordsNoID(t *testing.T) {
	for _, st := range []setup{allSetups[0], allSetups[1], allSetups[4]} {
		t.Run(st.Database, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dbURL, db, _ := expertTestServices(t, st, t.TempDir())
			tables := newCellTables(newID())
			require.NoError(t, tables.create(ctx, db))
			x, err := openExpertSQL(ctx, dbURL, tables, 1)
			require.NoError(t, err)
			t.Cleanup(func() { _ = x.close() })
			x.db.SetMaxOpenConns(1)

			msgs := []inMsg{{id: "m-1", payload: []byte("one")}, {id: "m-2"}}
			_, err = x.apply(ctx, msgs)
			require.Error(t, err)
			count := func(table string) (n int) {
				require.NoError(t, db.QueryRowxContext(ctx, `SELECT COUNT(*) FROM `+table).Scan(&n))
				return n
			}
			require.Zero(t, count(tables.processed), "ids recorded by the failed transaction")
			require.Zero(t, count(tables.effects), "rows written by the failed transaction")

			msgs[1].payload = []byte("two")
			fresh, err := x.apply(ctx, msgs)
			require.NoError(t, err)
			require.Equal(t, msgs, fresh)
			require.Equal(t, 2, count(tables.processed))
			require.Equal(t, 2, count(tables.effects))
		})
	}
}

// expertTestServices returns the URL and a pool of the database of st (dropped when the test
// ends) and the URL of its broker, or skips the test when a service is not running.
func expertTestServices(t *testing.T, st setup, dir string) (string, *sqldb.DB, string) {
	t.Helper()
	var brokerURL string
	switch st.Broker {
	case "amqp":
		brokerURL = testsvc.AMQPURL(t)
	case "nats":
		brokerURL = testsvc.NATSURL(t)
	case "redis":
		brokerURL = testsvc.RedisURL(t)
	default:
		brokerURL = "sqlite://" + filepath.Join(dir, "queue.db")
	}
	var dbURL string
	switch st.Database {
	case "postgres":
		dbURL = testsvc.PostgresSchemaURL(t)
	case "mysql":
		dbURL = testsvc.MySQLDatabaseURL(t)
	default:
		dbURL = "sqlite://" + filepath.Join(dir, "app.db")
	}
	db, err := sqldb.Open(context.Background(), dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return dbURL, db, brokerURL
}

// TestServerWAL_CountsTheSyncsOfACommit reads the log counters of PostgreSQL and MariaDB around
// a committed insert: the syncs must move, and so must the bytes written. PostgreSQL's backends
// report theirs when idle, at most once a second: the second reading is polled for.
func TestServerWAL_CountsTheSyncsOfACommit(t *testing.T) {
	for name, open := range map[string]func(testing.TB) *sqldb.DB{"postgres": testsvc.Postgres, "mysql": testsvc.MySQL} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			db := open(t)
			table := "bench_wal_" + newID()
			_, err := db.ExecContext(ctx, `CREATE TABLE `+table+` (id INT NOT NULL)`)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE `+table) })

			before := serverWAL(ctx, db)
			require.True(t, before.ok)
			tx, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			_, err = tx.ExecContext(ctx, `INSERT INTO `+table+` (id) VALUES (1)`)
			require.NoError(t, err)
			require.NoError(t, tx.Commit())
			var after walStats
			testsvc.Eventually(t, 10*time.Second, func() bool {
				after = serverWAL(ctx, db)
				return after.ok && after.syncs > before.syncs && after.bytes > before.bytes
			}, "log counters before %+v, after %+v", before, &after)
		})
	}
}
