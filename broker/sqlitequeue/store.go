package sqlitequeue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
)

// A queue file has one writer at a time: a subscription holds the write lock for its whole
// batch, a publisher for its insert. SQLite lets writers that find the lock taken sleep and try
// again (up to 100 ms apart), and a consumer with a backlog takes the lock again microseconds
// after it commits, so without help a waiting publisher almost never gets in until the backlog
// is gone. Within a process the queue therefore hands the file's writers their turns in arrival
// order, through a store shared by every Queue over the file; SQLite's lock still rules
// between processes.

// busyTimeout is the busy timeout that sqldb sets: how long SQLite lets a writer wait for
// the lock.
const busyTimeout = 30 * time.Second

// writeWait bounds how long a publisher waits for its turn: the busy timeout, and at least as
// long as a subscription that has stopped reading its messages can keep the turn (until its ack
// deadline, plus the margin).
func writeWait(ackDeadline time.Duration) time.Duration {
	return max(busyTimeout, ackDeadline+deadlineMargin(ackDeadline)+5*time.Second)
}

// store is one queue file as this process sees it: its identity, so that a publisher
// recognises the deliveries of any Queue over the file, and its turn to write.
type store struct {
	file os.FileInfo   // nil when the file cannot be identified (in-memory databases)
	turn chan struct{} // holds a token while a writer of this process has the turn
	refs int           // Queues using the store; guarded by stores.mu
}

var stores struct {
	mu   sync.Mutex
	list []*store
}

// openStore returns the store of the file at path, shared with every open Queue over the same
// file. Each call must be matched by a closeStore.
func openStore(path string) *store {
	var fi os.FileInfo
	if path != "" && !strings.HasPrefix(path, ":memory:") && !strings.Contains(path, "mode=memory") {
		fi, _ = os.Stat(path)
	}
	stores.mu.Lock()
	defer stores.mu.Unlock()
	if fi != nil {
		for _, s := range stores.list {
			if os.SameFile(s.file, fi) {
				s.refs++
				return s
			}
		}
	}
	s := &store{file: fi, turn: make(chan struct{}, 1), refs: 1}
	if fi != nil {
		stores.list = append(stores.list, s)
	}
	return s
}

// closeStore drops a reference to s taken by openStore.
func closeStore(s *store) {
	stores.mu.Lock()
	defer stores.mu.Unlock()
	s.refs--
	if s.refs > 0 {
		return
	}
	for i, o := range stores.list {
		if o == s {
			stores.list = append(stores.list[:i], stores.list[i+1:]...)
			return
		}
	}
}

// errNoTurn reports a publisher that waited writeWait for its turn.
var errNoTurn = errors.New("timed out waiting for the queue file's write lock, which a subscription of this process holds " +
	"(a handler that publishes to the queue file it consumes must publish with the delivered message's context, " +
	"and a subscription's messages must be read and acknowledged)")

// lock waits for the turn to write, in arrival order, until ctx ends or, if wait is positive,
// for at most wait.
func (s *store) lock(ctx context.Context, wait time.Duration) error {
	select { // fast path, and no timer when the turn is free
	case s.turn <- struct{}{}:
		return nil
	default:
	}
	var timeout <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case s.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-timeout:
		return errNoTurn
	}
}

// unlock gives the turn to the writer that has waited longest.
func (s *store) unlock() { <-s.turn }

// write runs fn in a transaction of the queue file, in this process's turn.
func (q *Queue) write(ctx context.Context, fn func(tx *sql.Tx) error) error {
	if err := q.store.lock(ctx, writeWait(q.cfg.AckDeadline)); err != nil {
		return err
	}
	defer q.store.unlock()
	return runInTx(ctx, rawDB(q.db), fn)
}

// subscriptionDB is the database handle and BackoffManager of one watermill-sql subscription.
// It takes the file's turn before each transaction and gives it back when watermill-sql, having
// committed or rolled back, asks how long to back off. (watermill-sql v3.1.0 follows every
// BeginTx of its polling loop with exactly one HandleError; the queue's OffsetsAdapter has no
// queries before subscribing, so no other BeginTx happens.)
type subscriptionDB struct {
	*sql.DB
	store   *store
	backoff backoff
	held    atomic.Bool
}

var (
	_ wsql.Beginner       = (*subscriptionDB)(nil)
	_ wsql.BackoffManager = (*subscriptionDB)(nil)
)

// BeginTx waits for the file's turn and begins a transaction.
func (d *subscriptionDB) BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error) {
	if err := d.store.lock(ctx, 0); err != nil {
		return nil, fmt.Errorf("wait for the queue file's turn: %w", err)
	}
	d.held.Store(true)
	tx, err := d.DB.BeginTx(ctx, opts)
	if err != nil {
		d.release()
		return nil, err
	}
	return tx, nil
}

// HandleError gives back the turn and returns the backoff.
func (d *subscriptionDB) HandleError(logger watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	d.release()
	return d.backoff.HandleError(logger, noMsg, err)
}

func (d *subscriptionDB) release() {
	if d.held.CompareAndSwap(true, false) {
		d.store.unlock()
	}
}
