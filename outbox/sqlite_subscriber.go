package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/sqllock"
)

// sqliteSubscriber is the relay's subscriber on SQLite. It is watermill-sql's subscriber
// protocol (read a batch after the group's offset, deliver it one message at a time, record
// the offset of the last acknowledged one) on the embedded queue's adapters, with one
// difference: it holds no write lock while the messages are published.
//
// watermill-sql's subscriber reads, delivers and records the offset in one transaction, and on
// SQLite a transaction that will write holds the database's write lock from its BEGIN
// IMMEDIATE. The relay would then hold the application database's write lock while it
// publishes, so that every writer of the application database, a handler's transaction
// among them, waits for the broker; and when the destination holds a lock of its own while
// its consumer writes the application database (as the embedded queue's subscriber did before
// it had leases), each waits for the other until SQLite's busy timeout ends it. So
// sqliteSubscriber reads without a transaction (in WAL mode a reader never waits for the
// writer, and since SQLite has one writer at a time, offsets become visible in increasing
// order), and records the offset in a short transaction of its own once the batch is done.
// Relays of one consumer group take turns through an exclusive lock on a file beside the
// database, tried without waiting at each poll.
type sqliteSubscriber struct {
	db          *sql.DB
	schema      wsql.SchemaAdapter
	offsets     wsql.OffsetsAdapter
	group       string
	lockPath    string // the group's lock file; "" for a database without a file
	resend      time.Duration
	ackDeadline time.Duration
	backoff     wsql.BackoffManager

	closing   chan struct{}
	closeOnce sync.Once
	running   sync.WaitGroup
}

var _ message.Subscriber = (*sqliteSubscriber)(nil)

// relayLockPath returns the lock file of the relays of group on table of the database file
// path: "<path>.<table>.relay-<hash of group>.lock". It is left in place after use.
func relayLockPath(path, table, group string) string {
	if path == "" {
		return ""
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(group))
	return fmt.Sprintf("%s.%s.relay-%08x.lock", path, table, h.Sum32())
}

// memoryLocks stands in for the lock file of databases without a file.
var memoryLocks sync.Map // map[*sql.DB]*sync.Mutex

// Subscribe registers the consumer group and starts delivering. The channel closes when ctx
// ends or the subscriber is closed.
func (s *sqliteSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	err := runInTx(ctx, s.db, func(tx *sql.Tx) error {
		return execAll(ctx, tx, s.offsets.BeforeSubscribingQueries(topic, s.group)...)
	})
	if err != nil {
		return nil, fmt.Errorf("register consumer group %q: %w", s.group, err)
	}
	var lockFile *os.File
	if s.lockPath != "" {
		if lockFile, err = os.OpenFile(s.lockPath, os.O_RDWR|os.O_CREATE, 0o644); err != nil {
			return nil, fmt.Errorf("open the relays' lock file: %w", err)
		}
	}
	out := make(chan *message.Message)
	s.running.Add(1)
	go s.consume(ctx, topic, lockFile, out)
	return out, nil
}

func (s *sqliteSubscriber) consume(ctx context.Context, topic string, lockFile *os.File, out chan<- *message.Message) {
	defer s.running.Done()
	defer close(out)
	if lockFile != nil {
		defer lockFile.Close()
	}
	var wait time.Duration
	for {
		timer := time.NewTimer(wait)
		select {
		case <-s.closing:
			timer.Stop()
			return
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
		noMsg, err := s.batch(ctx, topic, lockFile, out)
		wait = s.backoff.HandleError(watermill.NopLogger{}, noMsg, err)
	}
}

// batch sends one batch, in the group's turn, and records its offset. noMsg is true when
// there was nothing to send or another relay of the group had the turn.
func (s *sqliteSubscriber) batch(ctx context.Context, topic string, lockFile *os.File, out chan<- *message.Message) (noMsg bool, err error) {
	if lockFile != nil {
		held, err := sqllock.TryLockFile(lockFile)
		if err != nil {
			return false, fmt.Errorf("lock the relays' lock file: %w", err)
		}
		if !held {
			return true, nil
		}
		defer func() {
			if uerr := sqllock.UnlockFile(lockFile); uerr != nil {
				err = errors.Join(err, fmt.Errorf("unlock the relays' lock file: %w", uerr))
			}
		}()
	} else {
		mu, _ := memoryLocks.LoadOrStore(s.db, &sync.Mutex{})
		if !mu.(*sync.Mutex).TryLock() {
			return true, nil
		}
		defer mu.(*sync.Mutex).Unlock()
	}

	rows, err := s.read(ctx, topic)
	if err != nil || len(rows) == 0 {
		return true, err
	}
	var last *wsql.Row
	for i := range rows {
		if !s.deliver(ctx, rows[i].Msg, out) {
			break
		}
		last = &rows[i]
	}
	if last == nil {
		return true, nil
	}
	err = runInTx(ctx, s.db, func(tx *sql.Tx) error {
		return execAll(ctx, tx, s.offsets.AckMessageQuery(topic, *last, s.group))
	})
	if err != nil {
		return false, fmt.Errorf("record offset %d: %w", last.Offset, err)
	}
	return false, nil
}

// read returns the next batch after the group's offset.
func (s *sqliteSubscriber) read(ctx context.Context, topic string) ([]wsql.Row, error) {
	q := s.schema.SelectQuery(topic, s.group, s.offsets)
	rows, err := s.db.QueryContext(ctx, q.Query, q.Args...)
	if err != nil {
		return nil, fmt.Errorf("read messages: %w", err)
	}
	defer rows.Close()
	var batch []wsql.Row
	for rows.Next() {
		r, err := s.schema.UnmarshalMessage(rows)
		if err != nil {
			return nil, err
		}
		batch = append(batch, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read messages: %w", err)
	}
	return batch, rows.Close()
}

// deliver hands msg over until it is acked, publishing it again ResendInterval after each
// nack, and reports whether it was acked. It gives up when the subscriber closes, ctx ends or
// the ack deadline passes; an ack that arrived by then still counts.
func (s *sqliteSubscriber) deliver(ctx context.Context, msg *message.Message, out chan<- *message.Message) bool {
	dctx, cancel := context.WithTimeout(ctx, s.ackDeadline)
	defer cancel()
	msg.SetContext(dctx)
	for {
		select {
		case out <- msg:
		case <-s.closing:
			return false
		case <-dctx.Done():
			return false
		}
		select {
		case <-msg.Acked():
			return true
		case <-msg.Nacked():
			msg = msg.Copy()
			msg.SetContext(dctx)
			timer := time.NewTimer(s.resend)
			select {
			case <-timer.C:
			case <-s.closing:
				timer.Stop()
				return false
			case <-dctx.Done():
				timer.Stop()
				return false
			}
		case <-s.closing:
			return acked(msg)
		case <-dctx.Done():
			return acked(msg)
		}
	}
}

func acked(msg *message.Message) bool {
	select {
	case <-msg.Acked():
		return true
	default:
		return false
	}
}

// Close stops delivering and waits for the subscriptions to end; each records the offset of
// the messages acknowledged before it.
func (s *sqliteSubscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	s.running.Wait()
	return nil
}
