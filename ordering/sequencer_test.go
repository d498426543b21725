package ordering_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/sqldb"
)

// seqEnv is one test's database and migrated sequencer.
type seqEnv struct {
	db  *sqldb.DB
	seq *ordering.Sequencer
}

func forEachSeqDB(t *testing.T, test func(t *testing.T, e *seqEnv)) {
	t.Helper()
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			s, err := ordering.NewSequencer(db, ordering.SequencerConfig{})
			require.NoError(t, err)
			require.NoError(t, s.Migrate(context.Background()))
			require.NoError(t, s.Migrate(context.Background()), "idempotent")
			test(t, &seqEnv{db: db, seq: s})
		})
	}
}

// inTx runs fn in a transaction and commits it, or rolls it back when fn fails.
func (e *seqEnv) inTx(t *testing.T, fn func(tx *sqlx.Tx) error) error {
	t.Helper()
	tx, err := e.db.BeginTxx(context.Background(), nil)
	require.NoError(t, err)
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

func (e *seqEnv) next(t *testing.T, topic, key string, n int) uint64 {
	t.Helper()
	var first uint64
	require.NoError(t, e.inTx(t, func(tx *sqlx.Tx) error {
		var err error
		first, err = e.seq.Next(context.Background(), tx, topic, key, n)
		return err
	}))
	return first
}

func TestSequencer_NumbersEachTopicAndKeyFromOne(t *testing.T) {
	forEachSeqDB(t, func(t *testing.T, e *seqEnv) {
		require.Equal(t, uint64(1), e.next(t, "postings", "acct-1", 1))
		require.Equal(t, uint64(2), e.next(t, "postings", "acct-1", 1))
		require.Equal(t, uint64(3), e.next(t, "postings", "acct-1", 3), "3, 4 and 5")
		require.Equal(t, uint64(6), e.next(t, "postings", "acct-1", 1))
		require.Equal(t, uint64(1), e.next(t, "postings", "acct-2", 1), "another key")
		require.Equal(t, uint64(1), e.next(t, "statements", "acct-1", 1), "another topic")
		require.Equal(t, uint64(1), e.next(t, "postings", "ACCT-1", 1), "keys compare byte by byte")
	})
}

func TestSequencer_RolledBackNumbersAreGivenAgain(t *testing.T) {
	forEachSeqDB(t, func(t *testing.T, e *seqEnv) {
		e.next(t, "postings", "acct-1", 1)
		abort := errors.New("abort")
		err := e.inTx(t, func(tx *sqlx.Tx) error {
			n, err := e.seq.Next(context.Background(), tx, "postings", "acct-1", 2)
			require.NoError(t, err)
			require.Equal(t, uint64(2), n)
			return abort
		})
		require.ErrorIs(t, err, abort)
		require.Equal(t, uint64(2), e.next(t, "postings", "acct-1", 1), "no gap: the rolled-back numbers come again")
	})
}

func TestSequencer_ConcurrentProducersGetEveryNumberOnce(t *testing.T) {
	forEachSeqDB(t, func(t *testing.T, e *seqEnv) {
		const producers, each = 6, 20
		var mu sync.Mutex
		var got []int
		var wg sync.WaitGroup
		for range producers {
			wg.Go(func() {
				for range each {
					for attempt := 0; ; attempt++ {
						var n uint64
						err := e.inTx(t, func(tx *sqlx.Tx) error {
							var err error
							n, err = e.seq.Next(context.Background(), tx, "postings", "acct-1", 1)
							return err
						})
						if err == nil {
							mu.Lock()
							got = append(got, int(n))
							mu.Unlock()
							break
						}
						if !sqldb.IsRetryable(err) || attempt == 20 {
							t.Errorf("next: %v", err)
							return
						}
					}
				}
			})
		}
		wg.Wait()
		sort.Ints(got)
		want := make([]int, producers*each)
		for i := range want {
			want[i] = i + 1
		}
		require.Equal(t, want, got)
	})
}

func TestSequencer_RefusesInvalidArguments(t *testing.T) {
	t.Parallel()
	db := testsvc.SQLite(t)
	s, err := ordering.NewSequencer(db, ordering.SequencerConfig{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(context.Background()))
	tx, err := db.BeginTxx(context.Background(), nil)
	require.NoError(t, err)
	defer tx.Rollback()
	for _, tc := range []struct {
		topic, key string
		n          int
		want       string
	}{
		{"postings", "acct-1", 0, "n is 0"},
		{"", "acct-1", 1, "topic is empty"},
		{"postings", "", 1, "ordering key is empty"},
		{"postings", string(make([]byte, 300)), 1, "more than 255"},
	} {
		_, err := s.Next(context.Background(), tx, tc.topic, tc.key, tc.n)
		require.ErrorContains(t, err, tc.want)
	}
	_, err = ordering.NewSequencer(db, ordering.SequencerConfig{Table: "x;y"})
	require.ErrorContains(t, err, "Table")
}

func TestSetSequence_IsReadBackByTheConverter(t *testing.T) {
	t.Parallel()
	m := message.NewMessage("m1", nil)
	ordering.SetSequence(m, "acct-1", 42)
	md, err := converter.New(converter.Config{}).FromMessage("postings", m)
	require.NoError(t, err)
	require.Equal(t, "acct-1", md.Key)
	require.Equal(t, uint64(42), md.Sequence)
}

// collector is a destination broker that records what the relay sends.
type collector struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (c *collector) Publish(_ string, msgs ...*message.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.msgs = append(c.msgs, msgs...)
	return nil
}

func (c *collector) Close() error { return nil }

func (c *collector) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.msgs)
}

func TestSequencer_PublishStampsAndWritesToTheOutboxInTheHandlersTransaction(t *testing.T) {
	forEachSeqDB(t, func(t *testing.T, e *seqEnv) {
		ctx := context.Background()
		ob, err := outbox.New(e.db, outbox.Config{})
		require.NoError(t, err)
		require.NoError(t, ob.Migrate(ctx))

		// Outside a handler's transaction, Publish refuses.
		require.ErrorIs(t, e.seq.Publish(ctx, ob, "postings", "acct-1", message.NewMessage("x", nil)), outbox.ErrNoTransaction)

		// A producer of its own: two postings, committed.
		require.NoError(t, e.inTx(t, func(tx *sqlx.Tx) error {
			return e.seq.PublishTx(ctx, tx, ob, "postings", "acct-1", message.NewMessage("p1", []byte("+10")), message.NewMessage("p2", []byte("-3")))
		}))
		// One rolled back: its number is not used.
		require.Error(t, e.inTx(t, func(tx *sqlx.Tx) error {
			if err := e.seq.PublishTx(ctx, tx, ob, "postings", "acct-1", message.NewMessage("lost", nil)); err != nil {
				return err
			}
			return errors.New("rolled back")
		}))
		// In a handler's transaction (processor.TxFromContext).
		require.NoError(t, e.inTx(t, func(tx *sqlx.Tx) error {
			return e.seq.Publish(middleware.WithTx(ctx, tx), ob, "postings", "acct-1", message.NewMessage("p3", []byte("+1")))
		}))

		dest := &collector{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: e.db, Publisher: dest, PollInterval: 10 * time.Millisecond})
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- relay.Run(ctx) }()
		testsvc.Eventually(t, 20*time.Second, func() bool { return dest.count() == 3 }, "the relay did not send the 3 postings")
		require.NoError(t, relay.Close())
		require.NoError(t, <-done)

		var got []string
		for _, m := range dest.msgs {
			got = append(got, fmt.Sprintf("%s %s#%s", m.UUID, m.Metadata.Get(messagedata.HeaderKey), m.Metadata.Get(messagedata.HeaderSequence)))
		}
		require.Equal(t, []string{"p1 acct-1#1", "p2 acct-1#2", "p3 acct-1#3"}, got)
	})
}
