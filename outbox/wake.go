package outbox

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/onceflow/onceflow/sqldb"
)

// A relay claims new rows as soon as it hears that a transaction which published is
// committing, and otherwise every PollInterval. Publish is called before the commit, and on
// MySQL and SQLite nothing tells another session when a transaction has committed, so a relay
// that hears of a Publish chases the commit: it looks at once, then 1, 2, 4, ... ms later,
// until it has received a message or PollInterval has passed. Each look is one cheap query
// that takes no lock. It hears of a Publish
//
//   - from the Outbox, when the Publish ran in this process (any dialect);
//   - on PostgreSQL, from a notification on the outbox's channel, wherever the Publish ran:
//     the Outbox that published sends it from a session of its own right after the Publish
//     (at most one per announceEvery), or, with Config.NotifyInTransaction, inside the
//     transaction, when PostgreSQL delivers it at the commit.
//
// MySQL and SQLite relays in other processes find the rows at their next poll.

// announceEvery bounds how often an Outbox notifies the relays of other processes: the
// Publishes of a burst share a notification, and the relays' chase covers the rest.
const announceEvery = 5 * time.Millisecond

// announcer notifies the relays listening on an outbox that transactions have published, from
// a session of its own, outside those transactions: a notifying transaction would make
// PostgreSQL serialise their commits. Its goroutine runs while there is something to announce.
type announcer struct {
	db    *sqldb.DB
	stmt  string // the dialect's notify statement
	table string

	mu      sync.Mutex
	pending bool // a Publish since the last notification
	running bool // the goroutine runs
}

// announce schedules a notification, without waiting for it.
func (a *announcer) announce() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pending = true
	if !a.running {
		a.running = true
		go a.run()
	}
}

// run sends a notification for the Publishes announced since the last one, at most every
// announceEvery, until there are none. A notification that fails is not sent again: the
// relays find the rows at their next poll.
func (a *announcer) run() {
	for {
		a.mu.Lock()
		if !a.pending {
			a.running = false
			a.mu.Unlock()
			return
		}
		a.pending = false
		a.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _ = a.db.ExecContext(ctx, a.stmt, a.table)
		cancel()
		time.Sleep(announceEvery)
	}
}

// locals are the running relays of this process, by the outbox they relay (localKey).
var locals struct {
	mu     sync.Mutex
	relays map[string]map[*Relay]struct{}
}

// localKey names the outbox table of db among the relays of this process: two pools opened
// on the same URL name the same database.
func localKey(db *sqldb.DB, table string) string { return db.String() + "\x00" + table }

func registerLocal(r *Relay) {
	locals.mu.Lock()
	defer locals.mu.Unlock()
	if locals.relays == nil {
		locals.relays = map[string]map[*Relay]struct{}{}
	}
	if locals.relays[r.ob.local] == nil {
		locals.relays[r.ob.local] = map[*Relay]struct{}{}
	}
	locals.relays[r.ob.local][r] = struct{}{}
}

func unregisterLocal(r *Relay) {
	locals.mu.Lock()
	defer locals.mu.Unlock()
	delete(locals.relays[r.ob.local], r)
	if len(locals.relays[r.ob.local]) == 0 {
		delete(locals.relays, r.ob.local)
	}
}

// wakeLocal tells the relays of the outbox key in this process that a transaction has
// published.
func wakeLocal(key string) {
	locals.mu.Lock()
	defer locals.mu.Unlock()
	for r := range locals.relays[key] {
		r.hear()
	}
}

// hear tells the relay that a transaction has published, and commits now or soon.
func (r *Relay) hear() {
	select {
	case r.published <- struct{}{}:
	default:
	}
}

// chase wakes the relay's subscription each time the relay hears of a Publish, and again 1, 2,
// 4, ... ms later, until the relay has received a message since, or PollInterval has passed.
func (r *Relay) chase(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var (
		since  time.Time // when the relay heard of the Publish it chases
		delay  time.Duration
		active bool
	)
	for {
		var tick <-chan time.Time
		if active {
			tick = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-r.published:
			since, delay, active = time.Now(), time.Millisecond, true
			r.src.wake()
			timer.Reset(delay)
		case <-tick:
			if r.received.Load() >= since.UnixNano() || time.Since(since) >= r.cfg.PollInterval {
				active = false
				continue
			}
			r.src.wake()
			delay *= 2
			timer.Reset(delay)
		}
	}
}

// listener is a dialect whose relays can hear of Publishes in other processes.
type listener interface {
	// listen calls ready once it listens, then notified at each notification of a Publish to
	// the outbox, until ctx ends or it fails.
	listen(ctx context.Context, db *sqldb.DB, ready, notified func()) error
}

// listen makes the relay hear of the Publishes notified on the outbox's channel, until ctx
// ends; once it starts listening it chases as for a Publish it heard, for the commits it could
// not hear before: one of them may become visible to the relay's claims only a moment later,
// when an older transaction on the server ends. When listening fails, it tries again after
// RetryInterval; the relay polls meanwhile.
func (r *Relay) listen(ctx context.Context, l listener) {
	for {
		err := l.listen(ctx, r.cfg.DB, r.hear, r.hear)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, sqldb.ErrCannotListen) {
			r.logger.Info("outbox relay: the database connection cannot listen for notifications; polling", "error", err, "poll_interval", r.cfg.PollInterval)
			return
		}
		r.logger.Warn("outbox relay: listening for notifications failed; polling until it listens again", "error", err, "retry_in", r.cfg.RetryInterval)
		t := time.NewTimer(r.cfg.RetryInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}
