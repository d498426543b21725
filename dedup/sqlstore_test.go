package dedup_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// t0 is the time the tests' clocks start at.
var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// retention is the tests' Config.Retention.
const retention = time.Hour

// clock is a settable Config.Now.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}

// env is one test's database, store and clock.
type env struct {
	dialect sqldb.Dialect
	db      *sqldb.DB
	store   *dedup.SQLStore
	clock   *clock
}

// forEachDB runs test in parallel on a fresh, migrated store on every dialect.
func forEachDB(t *testing.T, test func(t *testing.T, e *env)) {
	t.Helper()
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, d.Open(t), dedup.Config{})
			require.NoError(t, e.store.Migrate(context.Background()))
			test(t, e)
		})
	}
}

// setup returns a store on db with the tests' retention and a clock at t0; it does not
// migrate.
func setup(t *testing.T, db *sqldb.DB, cfg dedup.Config) *env {
	t.Helper()
	c := &clock{now: t0}
	cfg.Now = c.Now
	if cfg.Retention == 0 {
		cfg.Retention = retention
	}
	store, err := dedup.New(db, cfg)
	require.NoError(t, err)
	return &env{dialect: db.Dialect, db: db, store: store, clock: c}
}

func (e *env) begin(t *testing.T) *sqlx.Tx {
	t.Helper()
	tx, err := e.db.BeginTxx(context.Background(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// record records key in tx and returns whether it was new.
func (e *env) record(t *testing.T, tx sqlx.ExtContext, key dedup.Key, internalID string) bool {
	t.Helper()
	fresh, err := e.store.Record(context.Background(), tx, key, internalID)
	require.NoError(t, err)
	return fresh
}

// recordCommitted records key in a transaction of its own and commits it.
func (e *env) recordCommitted(t *testing.T, key dedup.Key, internalID string) bool {
	t.Helper()
	tx := e.begin(t)
	fresh := e.record(t, tx, key, internalID)
	require.NoError(t, tx.Commit())
	return fresh
}

// recordManyCommitted records keys in a transaction of its own and commits it.
func (e *env) recordManyCommitted(t *testing.T, keys []dedup.Key) []bool {
	t.Helper()
	tx := e.begin(t)
	fresh, err := e.store.RecordMany(context.Background(), tx, keys)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	return fresh
}

// lookup looks key up outside any transaction.
func (e *env) lookup(t *testing.T, key dedup.Key) (string, bool) {
	t.Helper()
	id, found, err := e.store.Lookup(context.Background(), e.db, key)
	require.NoError(t, err)
	return id, found
}

func (e *env) stats(t *testing.T) dedup.Stats {
	t.Helper()
	st, err := e.store.Stats(context.Background())
	require.NoError(t, err)
	return st
}

func key(id string) dedup.Key { return dedup.Key{Handler: "billing", MessageID: id} }

// keys returns n keys with the ids prefix0 .. prefix<n-1>.
func keys(prefix string, n int) []dedup.Key {
	out := make([]dedup.Key, n)
	for i := range out {
		out[i] = key(fmt.Sprintf("%s%d", prefix, i))
	}
	return out
}

func TestConfig_ValidateNamesTheInvalidField(t *testing.T) {
	t.Parallel()
	require.NoError(t, dedup.Config{}.Validate())
	require.NoError(t, dedup.Config{Table: "my_dedup", Retention: time.Minute}.Validate())

	err := dedup.Config{Table: "dedup; DROP TABLE users"}.Validate()
	require.ErrorContains(t, err, `Table: "dedup; DROP TABLE users" is not a plain SQL identifier`)

	err = dedup.Config{Retention: -time.Second}.Validate()
	require.EqualError(t, err, "Retention: must not be negative, got -1s")
}

func TestNew_RejectsNilDatabaseAndInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := dedup.New(nil, dedup.Config{})
	require.EqualError(t, err, "dedup.New: db is nil")

	db := testsvc.SQLite(t)
	_, err = dedup.New(db, dedup.Config{Table: "1table"})
	require.ErrorContains(t, err, `dedup.New: Table: "1table"`)

	store, err := dedup.New(db, dedup.Config{})
	require.NoError(t, err)
	require.Equal(t, dedup.DefaultTable, store.Table())
	store, err = dedup.New(db, dedup.Config{Table: "custom_dedup"})
	require.NoError(t, err)
	require.Equal(t, "custom_dedup", store.Table())
}

func TestRecord_FreshThenDuplicate(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		k := key("m-1")
		require.True(t, e.recordCommitted(t, k, "int-1"))
		require.False(t, e.recordCommitted(t, k, "int-2"), "a committed key is a duplicate")

		id, found := e.lookup(t, k)
		require.True(t, found)
		require.Equal(t, "int-1", id, "a duplicate does not overwrite the internal id")

		// Within one transaction, the transaction's own key counts too.
		tx := e.begin(t)
		require.True(t, e.record(t, tx, key("m-2"), ""))
		require.False(t, e.record(t, tx, key("m-2"), ""))
		require.NoError(t, tx.Commit())
	})
}

func TestRecord_ExpiredKeyIsReplaced(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		k := key("m-1")
		require.True(t, e.recordCommitted(t, k, "first"))

		e.clock.Set(t0.Add(retention - time.Microsecond))
		require.False(t, e.recordCommitted(t, k, "second"), "one microsecond before expiry, still a duplicate")
		id, found := e.lookup(t, k)
		require.True(t, found)
		require.Equal(t, "first", id)

		e.clock.Set(t0.Add(retention))
		_, found = e.lookup(t, k)
		require.False(t, found, "Lookup ignores an expired key")
		require.True(t, e.recordCommitted(t, k, "third"), "an expired key is replaced and counts as new")
		id, found = e.lookup(t, k)
		require.True(t, found)
		require.Equal(t, "third", id)

		// The replacement expires Retention after it was recorded, not after the original.
		e.clock.Set(t0.Add(2*retention - time.Microsecond))
		require.False(t, e.recordCommitted(t, k, "fourth"))
		e.clock.Set(t0.Add(2 * retention))
		require.True(t, e.recordCommitted(t, k, ""))
		id, found = e.lookup(t, k)
		require.True(t, found)
		require.Equal(t, "", id, "the replacement's empty internal id replaces the old one")
	})
}

func TestLookup_FindsOnlyCommittedUnexpiredKeys(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		id, found := e.lookup(t, key("never-recorded"))
		require.False(t, found)
		require.Equal(t, "", id)

		require.True(t, e.recordCommitted(t, key("without-id"), ""))
		id, found = e.lookup(t, key("without-id"))
		require.True(t, found)
		require.Equal(t, "", id)

		tx := e.begin(t)
		require.True(t, e.record(t, tx, key("pending"), "int-9"))
		_, found = e.lookup(t, key("pending"))
		require.False(t, found, "another transaction's uncommitted key is not found")
		id, found, err := e.store.Lookup(context.Background(), tx, key("pending"))
		require.NoError(t, err)
		require.True(t, found, "the transaction's own key is found")
		require.Equal(t, "int-9", id)
		require.NoError(t, tx.Commit())
		id, found = e.lookup(t, key("pending"))
		require.True(t, found)
		require.Equal(t, "int-9", id)

		_, found = e.lookup(t, dedup.Key{Handler: "shipping", MessageID: "pending"})
		require.False(t, found, "the handler is part of the key")
	})
}

func TestRecord_IDsAreCaseAndSpaceSensitive(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		distinct := []dedup.Key{
			{Handler: "billing", MessageID: "abc"},
			{Handler: "billing", MessageID: "ABC"},
			{Handler: "billing", MessageID: "Abc"},
			{Handler: "billing", MessageID: "abc "},
			{Handler: "billing", MessageID: "ab"},
			{Handler: "billing", MessageID: "é"},
			{Handler: "billing", MessageID: "e"},
			{Handler: "billing", MessageID: "E"},
			{Handler: "Billing", MessageID: "abc"},
			{Handler: "billing ", MessageID: "abc"},
		}
		tx := e.begin(t)
		for _, k := range distinct {
			require.True(t, e.record(t, tx, k, ""), "%+v is a key of its own", k)
		}
		require.NoError(t, tx.Commit())
		tx = e.begin(t)
		for _, k := range distinct {
			require.False(t, e.record(t, tx, k, ""), "%+v is recorded", k)
		}
		require.NoError(t, tx.Commit())
		require.Equal(t, int64(len(distinct)), e.stats(t).Rows)
	})
}

func TestRecord_TimestampIsPartOfTheKey(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		for _, ts := range []int64{0, 1, 1_700_000_000_000_000, -5} {
			k := dedup.Key{Handler: "billing", MessageID: "m-1", Timestamp: ts}
			require.True(t, e.recordCommitted(t, k, ""), "timestamp %d", ts)
		}
		require.False(t, e.recordCommitted(t, dedup.Key{Handler: "billing", MessageID: "m-1", Timestamp: 1}, ""))
		_, found := e.lookup(t, dedup.Key{Handler: "billing", MessageID: "m-1", Timestamp: 2})
		require.False(t, found)
	})
}

// A batch of one handler's keys without timestamps goes over the ids alone on PostgreSQL; with
// one timestamp in it, or a second handler, over more arrays: the keys are the same either way.
func TestRecordKeys_KeysWithoutTimestampAreTheSameInEveryBatchShape(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		require.True(t, e.recordCommitted(t, key("m-1"), ""))
		for _, tc := range []struct {
			name string
			new  []dedup.Key // followed by key("m-1"), recorded already
			want []dedup.Outcome
		}{
			{"ids only", []dedup.Key{key("m-2"), key("m-3")}, []dedup.Outcome{dedup.Recorded, dedup.Recorded, dedup.Duplicate}},
			{"with a timestamp", []dedup.Key{key("m-2"), {Handler: "billing", MessageID: "m-1", Timestamp: 7}}, []dedup.Outcome{dedup.Recorded, dedup.Recorded, dedup.Duplicate}},
			{"two handlers", []dedup.Key{key("m-2"), {Handler: "shipping", MessageID: "m-1"}}, []dedup.Outcome{dedup.Recorded, dedup.Recorded, dedup.Duplicate}},
		} {
			batch := append(slices.Clone(tc.new), key("m-1"))
			tx := e.begin(t)
			got, err := e.store.RecordKeys(ctx, tx, batch)
			require.NoError(t, err)
			require.Equal(t, tc.want, got, tc.name)
			require.NoError(t, tx.Rollback())

			tx = e.begin(t)
			got, err = e.store.TryRecordKeys(ctx, tx, batch)
			require.NoError(t, err)
			require.Nil(t, got, "%s: key m-1 is not new", tc.name)
			require.NoError(t, tx.Rollback())

			tx = e.begin(t)
			got, err = e.store.TryRecordKeys(ctx, tx, tc.new)
			require.NoError(t, err)
			require.Equal(t, []dedup.Outcome{dedup.Recorded, dedup.Recorded}, got, tc.name)
			require.NoError(t, tx.Commit())
			for _, k := range tc.new {
				_, found := e.lookup(t, k)
				require.True(t, found, "%s: %+v", tc.name, k)
				require.NoError(t, e.store.Forget(ctx, e.db, k))
			}
			require.Equal(t, int64(1), e.stats(t).Rows, "%s: key m-1 alone is left", tc.name)
		}
	})
}

func TestRecord_RejectsKeysThatDoNotFitWithoutSpoilingTheTransaction(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		tx := e.begin(t)

		_, err := e.store.Record(ctx, tx, key(strings.Repeat("x", 256)), "")
		require.ErrorIs(t, err, dedup.ErrKeyTooLong)
		require.ErrorIs(t, err, dedup.ErrInvalidKey)
		require.ErrorContains(t, err, "message id")
		require.ErrorContains(t, err, "has 256 characters, more than the 255 its column holds")

		_, err = e.store.Record(ctx, tx, dedup.Key{Handler: strings.Repeat("h", 201), MessageID: "m"}, "")
		require.ErrorIs(t, err, dedup.ErrKeyTooLong)
		require.ErrorContains(t, err, "handler")
		require.ErrorContains(t, err, "has 201 characters, more than the 200 its column holds")

		_, err = e.store.Record(ctx, tx, key("m"), strings.Repeat("i", 65))
		require.ErrorIs(t, err, dedup.ErrKeyTooLong)
		require.ErrorContains(t, err, "internal id")

		_, _, err = e.store.Lookup(ctx, tx, key(strings.Repeat("ü", 256)))
		require.ErrorIs(t, err, dedup.ErrKeyTooLong)

		for name, k := range map[string]dedup.Key{
			"empty message id": key(""),
			"invalid UTF-8":    key("m\xff"),
			"NUL byte":         key("m\x00n"),
		} {
			_, err = e.store.Record(ctx, tx, k, "")
			require.ErrorIs(t, err, dedup.ErrInvalidKey, name)
			require.NotErrorIs(t, err, dedup.ErrKeyTooLong, name)
		}

		// Columns hold characters, not bytes: the longest values of four-byte characters fit.
		longest := dedup.Key{Handler: strings.Repeat("😀", 200), MessageID: strings.Repeat("😀", 255), Timestamp: 1}
		require.True(t, e.record(t, tx, longest, strings.Repeat("é", 64)))
		require.NoError(t, tx.Commit(), "rejected keys leave the transaction usable")

		id, found := e.lookup(t, longest)
		require.True(t, found)
		require.Equal(t, strings.Repeat("é", 64), id)
		_, found = e.lookup(t, dedup.Key{Handler: longest.Handler, MessageID: strings.Repeat("😀", 254), Timestamp: 1})
		require.False(t, found)
	})
}

func TestRecord_DuplicateLeavesTransactionUsable(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		_, err := e.db.ExecContext(ctx, "CREATE TABLE biz (id INT PRIMARY KEY)")
		require.NoError(t, err)
		require.True(t, e.recordCommitted(t, key("m-1"), ""))

		tx := e.begin(t)
		require.False(t, e.record(t, tx, key("m-1"), ""))
		// On PostgreSQL, a failed statement would abort the transaction: this INSERT and the
		// commit would fail.
		_, err = tx.ExecContext(ctx, tx.Rebind("INSERT INTO biz (id) VALUES (?)"), 7)
		require.NoError(t, err)
		require.True(t, e.record(t, tx, key("m-2"), ""))
		require.NoError(t, tx.Commit())

		var ids []int
		require.NoError(t, e.db.SelectContext(ctx, &ids, "SELECT id FROM biz"))
		require.Equal(t, []int{7}, ids)
		_, found := e.lookup(t, key("m-2"))
		require.True(t, found)
	})
}

func TestRecord_ConcurrentTransactionWaitsForTheFirst(t *testing.T) {
	for _, outcome := range []string{"commit", "rollback"} {
		t.Run("first "+outcome, func(t *testing.T) {
			forEachDB(t, func(t *testing.T, e *env) {
				ctx := context.Background()
				k := key("m-1")
				first := e.begin(t)
				require.True(t, e.record(t, first, k, "first"))

				type result struct {
					fresh bool
					err   error
				}
				done := make(chan result, 1)
				if e.dialect == sqldb.SQLite {
					// SQLite serialises writers at BEGIN IMMEDIATE: the second transaction
					// waits there until the first ends.
					go func() {
						tx, err := e.db.BeginTxx(ctx, nil)
						if err != nil {
							done <- result{err: err}
							return
						}
						defer tx.Rollback()
						fresh, err := e.store.Record(ctx, tx, k, "second")
						if err == nil {
							err = tx.Commit()
						}
						done <- result{fresh, err}
					}()
					select {
					case r := <-done:
						t.Fatalf("second transaction went through while the first was open: %+v", r)
					case <-time.After(200 * time.Millisecond):
					}
				} else {
					second := e.begin(t)
					session := sessionID(t, e, second)
					go func() {
						fresh, err := e.store.Record(ctx, second, k, "second")
						if err == nil {
							err = second.Commit()
						}
						done <- result{fresh, err}
					}()
					waitForLockWait(t, e, session)
					select {
					case r := <-done:
						t.Fatalf("second Record returned while the first transaction was open: %+v", r)
					default:
					}
				}

				if outcome == "commit" {
					require.NoError(t, first.Commit())
				} else {
					require.NoError(t, first.Rollback())
				}
				var r result
				select {
				case r = <-done:
				case <-time.After(30 * time.Second):
					t.Fatal("second Record did not return after the first transaction ended")
				}
				require.NoError(t, r.err)
				id, found := e.lookup(t, k)
				require.True(t, found)
				if outcome == "commit" {
					require.False(t, r.fresh, "the first transaction committed the key: duplicate")
					require.Equal(t, "first", id)
				} else {
					require.True(t, r.fresh, "the first transaction rolled back: the key is new")
					require.Equal(t, "second", id)
				}
			})
		})
	}
}

// sessionID returns the server's id of tx's connection.
func sessionID(t *testing.T, e *env, tx *sqlx.Tx) int64 {
	t.Helper()
	query := "SELECT pg_backend_pid()"
	if e.dialect == sqldb.MySQL {
		query = "SELECT CONNECTION_ID()"
	}
	var id int64
	require.NoError(t, tx.QueryRowx(query).Scan(&id))
	return id
}

// waitForLockWait polls the server until the session is waiting for a row lock.
//
// On MariaDB the session's statement must have run for 200 ms: information_schema.INNODB_TRX
// is a cache that is refreshed only after 100 ms without readers, so tests polling it in
// parallel would never see it change.
func waitForLockWait(t *testing.T, e *env, session int64) {
	t.Helper()
	query := "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'"
	if e.dialect == sqldb.MySQL {
		var version string
		require.NoError(t, e.db.QueryRowx("SELECT VERSION()").Scan(&version))
		query = "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = ? AND trx_state = 'LOCK WAIT'"
		if strings.Contains(version, "MariaDB") {
			query = "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND COMMAND = 'Query' AND INFO LIKE 'INSERT INTO%' AND TIME_MS >= 200"
		}
	}
	testsvc.Eventually(t, 20*time.Second, func() bool {
		var n int
		require.NoError(t, e.db.QueryRowx(query, session).Scan(&n))
		return n == 1
	}, "session %d never waited for the first transaction's lock", session)
}

func TestRecordMany_ReportsNewKeysByPosition(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		live, expired, fresh1, fresh2 := key("live"), key("expired"), key("fresh-1"), key("fresh-2")
		withTS := dedup.Key{Handler: "billing", MessageID: "live", Timestamp: 9}

		e.clock.Set(t0.Add(-2 * retention))
		require.True(t, e.recordCommitted(t, expired, "old"))
		e.clock.Set(t0)
		require.True(t, e.recordCommitted(t, live, "int-live"))

		tx := e.begin(t)
		got, err := e.store.RecordMany(ctx, tx, []dedup.Key{live, fresh1, expired, fresh1, fresh2, live, withTS, expired})
		require.NoError(t, err)
		require.Equal(t, []bool{false, true, true, false, true, false, true, false}, got)
		require.NoError(t, tx.Commit())

		for _, k := range []dedup.Key{live, expired, fresh1, fresh2, withTS} {
			_, found := e.lookup(t, k)
			require.True(t, found, "%+v", k)
		}
		id, _ := e.lookup(t, expired)
		require.Equal(t, "", id, "the renewed key was recorded without an internal id")
		id, _ = e.lookup(t, live)
		require.Equal(t, "int-live", id, "the duplicate is left alone")

		require.Equal(t, []bool{false, false, false}, e.recordManyCommitted(t, []dedup.Key{fresh1, fresh2, fresh1}))
		require.Equal(t, []bool{}, e.recordManyCommitted(t, nil))

		// Every key expired: each row is replaced.
		e.clock.Set(t0.Add(retention))
		require.Equal(t, []bool{true, true}, e.recordManyCommitted(t, []dedup.Key{fresh2, fresh1}))
	})
}

func TestRecordKeys_KeysOfSeveralHandlersInOneBatch(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		billing, shipping := key("same-id"), dedup.Key{Handler: "shipping", MessageID: "same-id"}
		require.True(t, e.recordCommitted(t, shipping, "int"))

		tx := e.begin(t)
		got, err := e.store.RecordKeys(ctx, tx, []dedup.Key{shipping, billing, {Handler: "shipping", MessageID: "other"}, billing})
		require.NoError(t, err)
		require.Equal(t, []dedup.Outcome{dedup.Duplicate, dedup.Recorded, dedup.Recorded, dedup.Duplicate}, got)
		require.NoError(t, tx.Commit())
	})
}

func TestRecordMany_LargeBatch(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		all := keys("m-", 2500)
		var every5th []dedup.Key
		for i := 0; i < len(all); i += 5 {
			every5th = append(every5th, all[i])
		}
		require.Equal(t, []bool{true, true}, e.recordManyCommitted(t, every5th[:2]))
		e.recordManyCommitted(t, every5th[2:])

		got := e.recordManyCommitted(t, all)
		require.Len(t, got, len(all))
		for i, fresh := range got {
			require.Equal(t, i%5 != 0, fresh, "position %d", i)
		}
		require.Equal(t, int64(2500), e.stats(t).Rows)
	})
}

func TestRecordMany_RejectsAnInvalidKeyBeforeWriting(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		tx := e.begin(t)
		_, err := e.store.RecordMany(context.Background(), tx, []dedup.Key{key("ok"), key(strings.Repeat("x", 300))})
		require.ErrorIs(t, err, dedup.ErrKeyTooLong)
		require.ErrorContains(t, err, "keys[1]: ")
		require.True(t, e.record(t, tx, key("ok"), ""), "nothing of the batch was written")
		require.NoError(t, tx.Commit())
	})
}

func TestForget_DeletesTheKeyInTheTransaction(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		require.True(t, e.recordCommitted(t, key("m-1"), ""))

		tx := e.begin(t)
		require.NoError(t, e.store.Forget(ctx, tx, key("m-1")))
		require.NoError(t, tx.Rollback())
		_, found := e.lookup(t, key("m-1"))
		require.True(t, found, "a rolled-back Forget forgets nothing")

		// Group commit: two members recorded together, the second one's savepoint rolled back.
		tx = e.begin(t)
		got, err := e.store.RecordMany(ctx, tx, []dedup.Key{key("m-2"), key("m-3")})
		require.NoError(t, err)
		require.Equal(t, []bool{true, true}, got)
		require.NoError(t, e.store.Forget(ctx, tx, key("m-3")))
		require.NoError(t, e.store.Forget(ctx, tx, key("m-1")))
		require.NoError(t, e.store.Forget(ctx, tx, key("never-recorded")))
		require.NoError(t, tx.Commit())

		_, found = e.lookup(t, key("m-2"))
		require.True(t, found)
		for _, id := range []string{"m-1", "m-3"} {
			_, found = e.lookup(t, key(id))
			require.False(t, found, id)
			require.True(t, e.recordCommitted(t, key(id), ""), "the redelivery of %s is new", id)
		}
	})
}

func TestMigrate_IsIdempotentAndSafeConcurrently(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url := d.URL(t)
			// Several processes, each with its own pool, migrate the same fresh database.
			const processes = 6
			stores := make([]*dedup.SQLStore, processes)
			for i := range stores {
				db, err := sqldb.Open(ctx, url)
				require.NoError(t, err)
				t.Cleanup(func() { _ = db.Close() })
				stores[i] = setup(t, db, dedup.Config{}).store
			}
			errs := make(chan error, processes)
			start := make(chan struct{})
			for _, s := range stores {
				go func() {
					<-start
					errs <- s.Migrate(ctx)
				}()
			}
			close(start)
			for range processes {
				require.NoError(t, <-errs)
			}
			require.NoError(t, stores[0].Migrate(ctx), "a second run changes nothing")

			db, err := sqldb.Open(ctx, url)
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			e := setup(t, db, dedup.Config{})
			require.True(t, e.recordCommitted(t, key("m-1"), ""))
			require.False(t, e.recordCommitted(t, key("m-1"), ""))
		})
	}
}

func TestMigrate_LongTableNameGetsItsIndex(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		table := strings.Repeat("t", 63)
		long := setup(t, e.db, dedup.Config{Table: table})
		require.NoError(t, long.store.Migrate(ctx))
		require.NoError(t, long.store.Migrate(ctx))
		require.True(t, long.recordCommitted(t, key("m-1"), ""))

		var indexes int
		switch e.dialect {
		case sqldb.Postgres:
			require.NoError(t, e.db.QueryRowx("SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND tablename = $1", table).Scan(&indexes))
		case sqldb.MySQL:
			require.NoError(t, e.db.QueryRowx("SELECT COUNT(DISTINCT INDEX_NAME) FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?", table).Scan(&indexes))
		case sqldb.SQLite:
			require.NoError(t, e.db.QueryRowx("SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", table).Scan(&indexes))
		}
		require.Equal(t, 2, indexes, "the primary key and the expires_at index")
	})
}

func TestMigrate_MySQLRejectsCaseInsensitiveTable(t *testing.T) {
	t.Parallel()
	db := testsvc.MySQL(t)
	_, err := db.Exec(`CREATE TABLE onceflow_dedup (
	handler VARCHAR(200) NOT NULL, message_id VARCHAR(255) NOT NULL, message_ts BIGINT NOT NULL DEFAULT 0,
	internal_id VARCHAR(64) NULL, created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, batch_token BIGINT NULL,
	PRIMARY KEY (handler, message_id, message_ts)) DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_general_ci`)
	require.NoError(t, err)
	e := setup(t, db, dedup.Config{})
	err = e.store.Migrate(context.Background())
	require.ErrorContains(t, err, "existing table compares ids case-insensitively (handler has collation utf8mb4_general_ci, message_id has collation utf8mb4_general_ci)")
}

// fillForPurge records n keys at t0 - retention (expired at t0) and live keys at t0, and
// leaves the clock at t0.
func fillForPurge(t *testing.T, e *env, expired, live int) {
	t.Helper()
	e.clock.Set(t0.Add(-retention))
	e.recordManyCommitted(t, keys("expired-", expired))
	e.clock.Set(t0)
	e.recordManyCommitted(t, keys("live-", live))
}

func TestPurge_DeletesOnlyExpiredKeysInBatches(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		fillForPurge(t, e, 2500, 100)
		require.Equal(t, dedup.Stats{Rows: 2600, Expired: 2500, Oldest: t0.Add(-retention).Local()}, e.stats(t))

		res, err := e.store.Purge(ctx, dedup.PurgeOptions{BatchSize: 1000})
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeResult{Deleted: 2500, Batches: 3}, res)
		require.Equal(t, dedup.Stats{Rows: 100, Expired: 0, Oldest: t0.Local()}, e.stats(t))
		_, found := e.lookup(t, key("live-99"))
		require.True(t, found)

		res, err = e.store.Purge(ctx, dedup.PurgeOptions{BatchSize: 1000})
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeResult{Deleted: 0, Batches: 1}, res)
	})
}

func TestPurge_RecordsWhatTheLastPurgeDid(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		last, err := e.store.LastPurge(ctx)
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeRecord{}, last, "never purged")

		fillForPurge(t, e, 30, 5)
		_, err = e.store.Purge(ctx, dedup.PurgeOptions{BatchSize: 20})
		require.NoError(t, err)
		last, err = e.store.LastPurge(ctx)
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeRecord{At: t0.Local(), Deleted: 30, Batches: 2}, last)

		e.clock.Set(t0.Add(time.Minute))
		_, err = e.store.Purge(ctx, dedup.PurgeOptions{})
		require.NoError(t, err)
		last, err = e.store.LastPurge(ctx)
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeRecord{At: t0.Add(time.Minute).Local(), Deleted: 0, Batches: 1}, last, "the last purge, not a sum")

		// A store whose table was migrated before the record existed reads no purge.
		old := setup(t, e.db, dedup.Config{Table: "old_dedup"})
		last, err = old.store.LastPurge(ctx)
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeRecord{}, last)
	})
}

func TestPurge_StopsAfterMaxBatches(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		fillForPurge(t, e, 2500, 10)

		res, err := e.store.Purge(ctx, dedup.PurgeOptions{BatchSize: 1000, MaxBatches: 2})
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeResult{Deleted: 2000, Batches: 2}, res)
		require.Equal(t, int64(510), e.stats(t).Rows)

		// A key expires at its expires_at exactly: Purge and Lookup agree.
		e.clock.Set(t0.Add(retention))
		_, found := e.lookup(t, key("live-0"))
		require.False(t, found)
		res, err = e.store.Purge(ctx, dedup.PurgeOptions{}) // batches of 1000, no limit
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeResult{Deleted: 510, Batches: 1}, res)
		require.Equal(t, dedup.Stats{}, e.stats(t))
	})
}

func TestPurge_RejectsNegativeOptions(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		_, err := e.store.Purge(context.Background(), dedup.PurgeOptions{BatchSize: -1})
		require.EqualError(t, err, "dedup: Purge: BatchSize: must not be negative, got -1")
		_, err = e.store.Purge(context.Background(), dedup.PurgeOptions{MaxBatches: -1})
		require.EqualError(t, err, "dedup: Purge: MaxBatches: must not be negative, got -1")
	})
}

func TestPurge_SkippedWhileAnotherPurgeHoldsTheLock(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		fillForPurge(t, e, 10, 0)
		other := setup(t, e.db, dedup.Config{Table: "other_dedup"})
		require.NoError(t, other.store.Migrate(ctx))
		fillForPurge(t, other, 3, 0)

		release, held, err := dedup.HoldPurgeLock(ctx, e.store)
		require.NoError(t, err)
		require.True(t, held)

		res, err := e.store.Purge(ctx, dedup.PurgeOptions{})
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeResult{Skipped: true}, res)
		require.Equal(t, int64(10), e.stats(t).Rows, "a skipped purge deletes nothing")

		res, err = other.store.Purge(ctx, dedup.PurgeOptions{})
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeResult{Deleted: 3, Batches: 1}, res, "the lock is per table")

		require.NoError(t, release())
		res, err = e.store.Purge(ctx, dedup.PurgeOptions{})
		require.NoError(t, err)
		require.Equal(t, dedup.PurgeResult{Deleted: 10, Batches: 1}, res)
	})
}

func TestPurge_ConcurrentPurgesAreHarmless(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		fillForPurge(t, e, 2500, 7)

		const purges = 4
		results := make(chan dedup.PurgeResult, purges)
		errs := make(chan error, purges)
		start := make(chan struct{})
		for range purges {
			go func() {
				<-start
				res, err := e.store.Purge(ctx, dedup.PurgeOptions{BatchSize: 100})
				results <- res
				errs <- err
			}()
		}
		close(start)
		var deleted int64
		ran := 0
		for range purges {
			require.NoError(t, <-errs)
			res := <-results
			if !res.Skipped {
				ran++
			} else {
				require.Equal(t, dedup.PurgeResult{Skipped: true}, res)
			}
			deleted += res.Deleted
		}
		require.GreaterOrEqual(t, ran, 1)
		require.Equal(t, int64(2500), deleted, "every expired row deleted once")
		require.Equal(t, dedup.Stats{Rows: 7, Oldest: t0.Local()}, e.stats(t))

		// After the purges, the lock is free again.
		release, held, err := dedup.HoldPurgeLock(ctx, e.store)
		require.NoError(t, err)
		require.True(t, held)
		require.NoError(t, release())
	})
}

func TestStats_CountsRowsAndOldest(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		require.Equal(t, dedup.Stats{}, e.stats(t))
		require.True(t, e.stats(t).Oldest.IsZero())

		first := t0.Add(123456 * time.Microsecond)
		e.clock.Set(first)
		require.True(t, e.recordCommitted(t, key("m-1"), ""))
		e.clock.Set(first.Add(time.Minute))
		require.True(t, e.recordCommitted(t, key("m-2"), ""))

		st := e.stats(t)
		require.Equal(t, int64(2), st.Rows)
		require.Equal(t, int64(0), st.Expired)
		require.True(t, st.Oldest.Equal(first), "oldest %s, want %s", st.Oldest, first)

		e.clock.Set(first.Add(retention))
		st = e.stats(t)
		require.Equal(t, dedup.Stats{Rows: 2, Expired: 1, Oldest: first.Local()}, st)
	})
}

// BenchmarkRecord measures one Record of a new key, the statement every message pays for; the
// transactions commit every 1000 keys.
func BenchmarkRecord(b *testing.B) {
	for _, d := range testsvc.Databases() {
		b.Run(d.Name, func(b *testing.B) {
			ctx := context.Background()
			db := d.Open(b)
			store, err := dedup.New(db, dedup.Config{})
			require.NoError(b, err)
			require.NoError(b, store.Migrate(ctx))
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = fmt.Sprintf("message-%d", i)
			}
			b.ReportAllocs()
			b.ResetTimer()
			var tx *sqlx.Tx
			for i := range b.N {
				if i%1000 == 0 {
					if tx != nil {
						require.NoError(b, tx.Commit())
					}
					tx, err = db.BeginTxx(ctx, nil)
					require.NoError(b, err)
				}
				fresh, err := store.Record(ctx, tx, dedup.Key{Handler: "billing", MessageID: ids[i]}, "")
				if err != nil || !fresh {
					b.Fatalf("Record: %v, %v", fresh, err)
				}
			}
			require.NoError(b, tx.Commit())
		})
	}
}

// createLegacyTable creates table in the layout that PostgreSQL and SQLite dedup tables had
// before their primary key was led by message_id (and, on PostgreSQL, compared byte by byte).
func createLegacyTable(t testing.TB, db *sqldb.DB, table string) {
	t.Helper()
	_, err := db.ExecContext(context.Background(), `CREATE TABLE `+db.Dialect.Quote(table)+` (
	handler VARCHAR(200) NOT NULL, message_id VARCHAR(255) NOT NULL, message_ts BIGINT NOT NULL DEFAULT 0,
	internal_id VARCHAR(64), created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL,
	PRIMARY KEY (handler, message_id, message_ts))`)
	require.NoError(t, err)
}

// A PostgreSQL table is keyed by message_id first, compared byte by byte.
func TestMigrate_PostgresKeyLedByTheMessageIDInByteOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.Postgres(t)
	e := setup(t, db, dedup.Config{})
	require.NoError(t, e.store.Migrate(ctx))
	var pk, collation string
	require.NoError(t, db.QueryRowContext(ctx, `SELECT pg_get_constraintdef(oid) FROM pg_constraint
WHERE conrelid = $1::regclass AND contype = 'p'`, dedup.DefaultTable).Scan(&pk))
	require.Equal(t, "PRIMARY KEY (message_id, handler, message_ts)", pk)
	require.NoError(t, db.QueryRowContext(ctx, `SELECT collation_name FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = $1 AND column_name = 'message_id'`, dedup.DefaultTable).Scan(&collation))
	require.Equal(t, "C", collation)
}

// A table created by an earlier version keeps its layout, and every statement works on it.
func TestSQLStore_WorksOnATableOfTheEarlierLayout(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		if d.Name == "mysql" {
			continue // its layout did not change
		}
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := d.Open(t)
			createLegacyTable(t, db, "legacy_dedup")
			e := setup(t, db, dedup.Config{Table: "legacy_dedup"})
			require.NoError(t, e.store.Migrate(ctx))

			require.True(t, e.recordCommitted(t, key("m-1"), ""))
			require.False(t, e.recordCommitted(t, key("m-1"), ""), "a duplicate")
			tx := e.begin(t)
			fresh, err := e.store.RecordMany(ctx, tx, []dedup.Key{key("m-1"), key("m-2"), key("m-3"), key("m-2")})
			require.NoError(t, err)
			require.Equal(t, []bool{false, true, true, false}, fresh)
			require.NoError(t, e.store.Forget(ctx, tx, key("m-3")))
			require.NoError(t, tx.Commit())
			require.True(t, e.recordCommitted(t, key("m-3"), ""), "forgotten, so new again")
			e.clock.Set(t0.Add(retention))
			require.True(t, e.recordCommitted(t, key("m-2"), ""), "expired, so new again")
		})
	}
}

// BenchmarkRecordMany measures the statement of group commit: RecordMany of 64 new keys, as a
// group of 64 messages records its ids; the transactions commit every 16 statements, so that
// the commits weigh little beside the statement. One op is one key. On
// PostgreSQL and SQLite it runs on the table Migrate creates and on a table of the layout
// tables had before (the primary key led by the handler; on PostgreSQL in the database's
// collation), which a store uses as it finds it: their ratio is the layout's gain. On the
// current table it runs TryRecordKeys too (current-try), the statement of a group of first
// deliveries. cpu-µs/msg is the client's CPU time per key (a message's), which the server's
// time in ns/op hides.
func BenchmarkRecordMany(b *testing.B) {
	const group = 64
	for _, d := range testsvc.Databases() {
		layouts := []string{"current", "current-try"}
		if d.Name != "mysql" {
			layouts = append(layouts, "legacy")
		}
		for _, layout := range layouts {
			b.Run(d.Name+"/"+layout, func(b *testing.B) {
				ctx := context.Background()
				db := d.Open(b)
				table := testsvc.UniqueName("bench_dedup")
				if layout == "legacy" {
					createLegacyTable(b, db, table)
				}
				store, err := dedup.New(db, dedup.Config{Table: table})
				require.NoError(b, err)
				require.NoError(b, store.Migrate(ctx))
				record := store.RecordKeys
				if layout == "current-try" {
					record = store.TryRecordKeys
				}
				keys := benchKeys(b.N)
				b.ReportAllocs()
				b.ResetTimer()
				var cost testsvc.Cost
				cost.Start()
				var tx *sqlx.Tx
				for i := 0; i < b.N; i += group {
					if i%(16*group) == 0 {
						if tx != nil {
							require.NoError(b, tx.Commit())
						}
						tx, err = db.BeginTxx(ctx, nil)
						require.NoError(b, err)
					}
					fresh, err := record(ctx, tx, keys[i:min(i+group, b.N)])
					require.NoError(b, err)
					require.NotContains(b, fresh, dedup.Duplicate)
				}
				require.NoError(b, tx.Commit())
				cost.Stop()
				cost.Report(b, b.N)
			})
		}
	}
}

// benchKeys returns n distinct keys of one handler, with ids shaped like UUIDs and spread over
// the key space as random ids are.
func benchKeys(n int) []dedup.Key {
	keys := make([]dedup.Key, n)
	for i := range keys {
		keys[i] = dedup.Key{Handler: "billing-exactly-once", MessageID: fmt.Sprintf("%08x-4c1d-%04x-9e3a-%012d", i*2654435761%(1<<32), i%65536, i)}
	}
	return keys
}

// BenchmarkGroupCommit_SQLiteAutocheckpoint runs the write transactions of group commit on the
// embedded default, one after the other: 64 messages per transaction, their ids recorded with
// RecordMany and a 1 KiB business row each, on a file opened as sqldb.Open leaves it and on one
// that copies its log back into the file every 1,000 pages, SQLite's own default. It reports
// the slowest transaction too (one that copies the log). Run it with -benchtime 150000x or
// more: a short run measures the log's first growth.
func BenchmarkGroupCommit_SQLiteAutocheckpoint(b *testing.B) {
	const group = 64
	payload := []byte(strings.Repeat("x", 1024))
	for _, tc := range []struct{ name, query string }{
		{"open-default", ""},
		{"sqlite-default-1000", "?_pragma=wal_autocheckpoint(1000)"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ctx := context.Background()
			db, err := sqldb.Open(ctx, testsvc.SQLiteURL(b)+tc.query)
			require.NoError(b, err)
			b.Cleanup(func() { _ = db.Close() })
			store, err := dedup.New(db, dedup.Config{Table: "processed"})
			require.NoError(b, err)
			require.NoError(b, store.Migrate(ctx))
			_, err = db.ExecContext(ctx, `CREATE TABLE effects (message_id TEXT NOT NULL, payload BLOB)`)
			require.NoError(b, err)
			keys := benchKeys(b.N)
			var slowest time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i += group {
				start := time.Now()
				chunk := keys[i:min(i+group, b.N)]
				var effects strings.Builder
				effects.WriteString(`INSERT INTO effects (message_id, payload) VALUES `)
				args := make([]any, 0, 2*len(chunk))
				for j, k := range chunk {
					if j > 0 {
						effects.WriteByte(',')
					}
					effects.WriteString("(?, ?)")
					args = append(args, k.MessageID, payload)
				}
				tx, err := db.BeginTxx(ctx, nil)
				require.NoError(b, err)
				fresh, err := store.RecordMany(ctx, tx, chunk)
				require.NoError(b, err)
				require.NotContains(b, fresh, false)
				_, err = tx.ExecContext(ctx, effects.String(), args...)
				require.NoError(b, err)
				require.NoError(b, tx.Commit())
				slowest = max(slowest, time.Since(start))
			}
			b.ReportMetric(float64(slowest.Microseconds())/1000, "slowest-ms")
		})
	}
}

func TestRecordKey_TellsARenewedExpiredKeyFromANewOne(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		record := func(k dedup.Key) dedup.Outcome {
			tx := e.begin(t)
			o, err := e.store.RecordKey(ctx, tx, k, "")
			require.NoError(t, err)
			require.NoError(t, tx.Commit())
			return o
		}
		k := key("m-1")
		require.Equal(t, dedup.Recorded, record(k))
		require.Equal(t, dedup.Duplicate, record(k))
		e.clock.Set(t0.Add(retention))
		require.Equal(t, dedup.Renewed, record(k), "the expired record was still there")
		require.Equal(t, dedup.Duplicate, record(k))
	})
}

func TestRecordKeys_TellsRenewedExpiredKeysByPosition(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		recordsRenewedByPosition(t, e)
		if e.dialect == sqldb.MySQL {
			// MySQL has no INSERT ... RETURNING: the keys are read back by their batch token.
			t.Run("without RETURNING", func(t *testing.T) {
				dedup.WithoutReturning(e.store)
				e.clock.Set(t0)
				recordsRenewedByPosition(t, e)
			})
		}
	})
}

func recordsRenewedByPosition(t *testing.T, e *env) {
	ctx := context.Background()
	expired, live := key("expired-"+t.Name()), key("live-"+t.Name())
	e.clock.Set(t0.Add(-2 * retention))
	require.True(t, e.recordCommitted(t, expired, ""))
	e.clock.Set(t0)
	require.True(t, e.recordCommitted(t, live, ""))

	for _, batch := range [][]dedup.Key{
		{key("new-1"), expired, live, key("new-2")},
		{key("new-3"), key("new-4")},
	} {
		tx := e.begin(t)
		got, err := e.store.RecordKeys(ctx, tx, batch)
		require.NoError(t, err)
		require.NoError(t, tx.Rollback())
		if len(batch) == 4 {
			require.Equal(t, []dedup.Outcome{dedup.Recorded, dedup.Renewed, dedup.Duplicate, dedup.Recorded}, got)
		} else {
			require.Equal(t, []dedup.Outcome{dedup.Recorded, dedup.Recorded}, got)
		}
	}
	// Only renewals: MySQL's rows affected says so without reading back.
	e.clock.Set(t0.Add(3 * retention))
	tx := e.begin(t)
	got, err := e.store.RecordKeys(ctx, tx, []dedup.Key{expired, live})
	require.NoError(t, err)
	require.Equal(t, []dedup.Outcome{dedup.Renewed, dedup.Renewed}, got)
}

func TestTryRecordKeys_RecordsNewKeysAndRefusesABatchWithAnyOther(t *testing.T) {
	forEachDB(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		expired, live := key("expired"), key("live")
		e.clock.Set(t0.Add(-2 * retention))
		require.True(t, e.recordCommitted(t, expired, ""))
		e.clock.Set(t0)
		require.True(t, e.recordCommitted(t, live, ""))

		tx := e.begin(t)
		got, err := e.store.TryRecordKeys(ctx, tx, []dedup.Key{key("new-1"), key("new-2"), key("new-1")})
		require.NoError(t, err)
		require.Equal(t, []dedup.Outcome{dedup.Recorded, dedup.Recorded, dedup.Duplicate}, got, "a later copy in the batch is a duplicate")
		require.NoError(t, tx.Commit())
		for _, k := range []dedup.Key{key("new-1"), key("new-2")} {
			_, found := e.lookup(t, k)
			require.True(t, found, "%+v", k)
		}

		for _, other := range []dedup.Key{live, expired} {
			tx := e.begin(t)
			batch := []dedup.Key{key("new-3"), other}
			got, err := e.store.TryRecordKeys(ctx, tx, batch)
			require.NoError(t, err)
			require.NoError(t, tx.Rollback())
			require.Nil(t, got, "%s: the batch holds a key that is not new", other.MessageID)
		}
		_, found := e.lookup(t, key("new-3"))
		require.False(t, found, "rolled back")
	})
}

func TestMariaDBReturns_OnlyFromMariaDB105(t *testing.T) {
	for version, want := range map[string]bool{
		"10.11.19-MariaDB-0+deb12u1": true,
		"10.5.0-MariaDB":             true,
		"11.4.2-MariaDB-log":         true,
		"10.4.34-MariaDB":            false,
		"5.5.5-10.3.39-MariaDB":      false, // the replication prefix MariaDB 10 gives old clients
		"8.0.36":                     false, // MySQL has no INSERT ... RETURNING
		"":                           false,
	} {
		require.Equal(t, want, dedup.MariaDBReturns(version), version)
	}
}
