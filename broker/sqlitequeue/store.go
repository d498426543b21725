package sqlitequeue

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

// A queue file has one writer at a time. Every write of the queue is a short transaction (a
// publish, a subscription's claim of messages, its settling of acknowledgements and nacks), but
// SQLite lets a writer that finds the lock taken sleep and try again, up to 100 ms apart, so
// that writers of one process that collide wait far longer than the writes take. Within a
// process the queue therefore hands the file's writers their turns in arrival order, through a
// store shared by every Queue over the file; SQLite's lock still rules between processes.
// Measured with four subscriptions of one process draining a backlog: a publisher of the
// process waited about 2 ms on average and at most about 10 ms with the turns, 4 to 9 ms on
// average and up to 80 ms without them.
//
// The store also tells the subscriptions of this process when a topic gets new messages, so
// that an idle subscription claims them at once rather than at its next poll.

// busyTimeout is the busy timeout that sqldb sets: how long SQLite lets a writer wait for
// the lock.
const busyTimeout = 30 * time.Second

// store is one queue file as this process sees it: its identity, its turn to write, and the
// wake-ups of its subscriptions.
type store struct {
	file os.FileInfo   // nil when the file cannot be identified (in-memory databases)
	turn chan struct{} // holds a token while a writer of this process has the turn
	refs int           // Queues using the store; guarded by stores.mu

	mu    sync.Mutex
	wakes dbqueue.Wakes // per topic: when messages are published to it
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

// errNoTurn reports a writer that waited busyTimeout for its turn.
var errNoTurn = errors.New("timed out waiting for the queue file's turn to write: another writer of this process held it for 30 s")

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
	if err := q.store.lock(ctx, busyTimeout); err != nil {
		return err
	}
	defer q.store.unlock()
	return runInTx(ctx, rawDB(q.db), fn)
}

// writeLeases runs fn, a claim or a settlement of leases, in a transaction of the queue file
// on the Queue's lease connection (synchronous=NORMAL, see leaseConn), in this process's turn.
func (q *Queue) writeLeases(ctx context.Context, fn func(tx *sql.Tx) error) error {
	if err := q.store.lock(ctx, busyTimeout); err != nil {
		return err
	}
	defer q.store.unlock()
	return q.leases.run(ctx, rawDB(q.db), fn)
}

// woken returns a channel that is closed when messages are next published to topic through a
// Queue of this process over the file.
func (s *store) woken(topic string) <-chan struct{} { return s.wakes.Woken(topic) }

// published wakes the subscriptions waiting for messages of topic.
func (s *store) published(topic string) { s.wakes.Wake(topic) }
