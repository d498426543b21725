package middleware

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// GroupStore is the duplicate-detection store of GroupCommit: it records the keys of a whole
// group with one statement, and forgets the key of a member whose writes were rolled back.
// *dedup.SQLStore satisfies it.
type GroupStore interface {
	// RecordMany records keys in tx and reports for each position whether it was newly
	// recorded; a key repeated in keys is new at most at its first position.
	RecordMany(ctx context.Context, tx sqlx.ExtContext, keys []dedup.Key) ([]bool, error)
	// Forget deletes key in tx.
	Forget(ctx context.Context, tx sqlx.ExtContext, key dedup.Key) error
}

var _ GroupStore = (*dedup.SQLStore)(nil)

// Group commit defaults.
const (
	// DefaultMaxGroupSize is the most members of one group.
	DefaultMaxGroupSize = 64
	// DefaultMaxGroupWait is how long a group waits for more members after its first when a
	// transaction could start at once: none. Messages that arrive while the handler's
	// transactions are busy form the next group by themselves, so groups grow with the load
	// and a message arriving at a quiet moment is not held back.
	DefaultMaxGroupWait time.Duration = 0
)

// AttrGroupSize is the number of members of the group whose transaction committed a message,
// on its onceflow.commit span.
const AttrGroupSize = attribute.Key("onceflow.group.size")

// ErrGroupAborted reports a member of a group whose own processing succeeded, or never ran,
// but whose group's transaction was rolled back: a statement of the group itself failed (BEGIN,
// the id insert, a savepoint, the connection was lost, ...). Nothing of the member was
// committed; the error is retryable.
var ErrGroupAborted = errors.New("group transaction rolled back")

// errCopyFailed reports an in-group copy of a message whose first copy in the same group was
// not committed: the copy is retried rather than taken for a duplicate.
var errCopyFailed = errors.New("another copy of this message in the same group was not committed")

// savepointName is the savepoint set before each member once a member of its group has failed;
// PostgreSQL, MySQL, MariaDB and SQLite share the syntax. Every member reuses the name and none
// is released, which saves a round trip per member: PostgreSQL and SQLite nest a savepoint
// inside the one of the same name before it, MySQL replaces that one, and either way ROLLBACK
// TO SAVEPOINT returns to the newest, the failing member's own. COMMIT ends them all.
const savepointName = "onceflow_member"

// GroupOption configures GroupCommit and GroupTransaction. Besides the options below,
// WithIsolation sets the isolation level of the group's transaction, and WithTimestampKey
// makes GroupCommit's keys include the message timestamp, as they do for Deduplicate.
type GroupOption interface{ applyGroup(*groupConfig) }

type groupOptionFunc func(*groupConfig)

func (f groupOptionFunc) applyGroup(c *groupConfig) { f(c) }

func (o TxOption) applyGroup(c *groupConfig) { o(&c.txOpts) }

func (o DedupOption) applyGroup(c *groupConfig) {
	o(&c.dedup)
	c.dedupOptions = true
}

// WithMaxGroupSize sets the most messages one group holds; a full group starts as soon as a
// transaction may. Defaults to DefaultMaxGroupSize. 1 turns grouping off: every message has a
// transaction of its own.
func WithMaxGroupSize(n int) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.maxSize = n })
}

// WithMaxWait sets how long a group that is not full waits for more members after its first
// one joined, when a transaction could start at once. Defaults to DefaultMaxGroupWait (0: it
// starts at once). A group never waits for a transaction to be free longer than that takes:
// while every transaction is busy, the messages that arrive form the next group, which starts
// as soon as one is free.
func WithMaxWait(d time.Duration) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.maxWait = d })
}

// WithConcurrency sets how many groups may have their transactions running at once, each on a
// connection of its own: while some commit, the next ones collect their members. The router
// passes Handler.Concurrency. Defaults to 1.
func WithConcurrency(n int) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.concurrency = n })
}

// WithBatch makes the group hand its new messages to b in one call, instead of running the
// rest of the chain for each: b's ProcessBatch runs in the group's transaction and may write
// all of them with one statement. The middleware then ignores the processor it wraps; nothing
// may stand between it and the processor in the chain. processor.Batch documents what b's
// result does to each message.
func WithBatch(b processor.Batch) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.batch = b })
}

type groupConfig struct {
	maxSize      int
	maxWait      time.Duration
	concurrency  int
	txOpts       sql.TxOptions
	dedup        dedupConfig
	dedupOptions bool
	batch        processor.Batch
	hooks        groupHooks
}

// groupHooks let tests observe the grouping; every field may be nil.
type groupHooks struct {
	// joined is called after a member joined an open group, with the group's size then.
	joined func(size int)
}

func newGroupConfig(opts []GroupOption) (groupConfig, error) {
	cfg := groupConfig{maxSize: DefaultMaxGroupSize, maxWait: DefaultMaxGroupWait, concurrency: 1}
	for _, o := range opts {
		o.applyGroup(&cfg)
	}
	switch {
	case cfg.maxSize < 1:
		return cfg, fmt.Errorf("WithMaxGroupSize: %d is not a group size (want at least 1)", cfg.maxSize)
	case cfg.maxWait < 0:
		return cfg, fmt.Errorf("WithMaxWait: %s is negative", cfg.maxWait)
	case cfg.concurrency < 0:
		return cfg, fmt.Errorf("WithConcurrency: %d is negative", cfg.concurrency)
	case cfg.dedup.checkFirst:
		return cfg, errors.New("CheckFirst: not supported by group commit (a group records its keys with one multi-row insert, without internal ids)")
	}
	cfg.concurrency = max(cfg.concurrency, 1)
	return cfg, nil
}

// GroupCommit processes concurrent deliveries in groups that share one database transaction,
// and records their message ids for handler in store in that transaction: the exactly-once
// work of Transaction and Deduplicate, with one commit for many messages. It replaces both in
// a chain; Retry stays outside it, so each attempt of a message joins a group of its own.
//
// Each message joins the open group and waits. Up to WithConcurrency groups run at once; a
// group starts when a transaction may start and it is full, or its MaxWait has passed (at
// once by default). While every transaction is busy, arriving messages collect in the next
// group, up to MaxSize, so groups grow with the load. A group's transaction:
//
//  1. records the ids of all members with one multi-row statement (GroupStore.RecordMany);
//     a member whose id is recorded already is a duplicate and is not processed;
//  2. runs the rest of the chain for each new member in turn, in the order they joined (or,
//     with WithBatch, hands all of them to the batch processor in one call);
//  3. commits once.
//
// Nothing is paid per member for isolating failures on the way to a commit that succeeds.
// When a member fails (an error or a panic of its own), the transaction is rolled back and the
// group runs again without it, each remaining member then under a SAVEPOINT of its own, so
// that a further failure rolls back alone. A batch that fails names its failing messages
// (processor.ErrorFor) and runs again without them, or, when it names none, is split in halves
// that run on their own until the failing messages are found; a lost connection, a
// serialization failure or a deadlock fails the whole group retryably instead.
//
// Each message then gets its own outcome, as Transaction and Deduplicate would give it, and
// only after the outcome of the transaction that holds its effect is known: nil once that
// commit succeeded (the router acks); its own error or panic, re-raised in its own goroutine;
// an error wrapping processor.ErrDuplicate for a duplicate. When a statement of the group
// itself fails (BEGIN, the id insert, a savepoint, COMMIT) every member gets an error, which
// wraps ErrCommitOutcomeUnknown when the connection was lost during COMMIT and ErrGroupAborted
// for a member whose own processing had succeeded: none is acknowledged, and each is retried.
// A message without an id is refused with a permanent error wrapping
// messagedata.ErrNoMessageID, before it joins a group.
//
// A processor may thus run more than once for one message within one delivery: its database
// writes commit exactly once; effects outside the database must tolerate a repeat, as they must
// for Retry.
//
// Contexts: the group's own statements (BEGIN, the id insert, savepoints, COMMIT) run under a
// context that no single member ends; it ends only when every member's context has ended, and
// then the transaction rolls back. A member whose context ends while it waits for its group
// to start, or for its turn, leaves the group and returns the context's error; the rest of the
// chain and the processor run under the member's own context. The drivers close the connection
// of a statement whose context ends while it runs, so a member that times out inside a
// statement makes its whole group fail and retry.
//
// The members of a group run one after the other on one connection: group commit pays off
// when the commit dominates the time of a message, and loses when the processor spends its
// time elsewhere (a remote call, a long query), which per-message transactions run in
// parallel. A group also holds the locks of all its members until it commits.
//
// It returns an error for an invalid option, or for CheckFirst, which group commit does not
// support.
func GroupCommit(db Beginner, store GroupStore, handler string, opts ...GroupOption) (Middleware, error) {
	if store == nil {
		return nil, errors.New("GroupCommit: store is nil (use GroupTransaction to group transactions without duplicate detection)")
	}
	cfg, err := newGroupConfig(opts)
	if err != nil {
		return nil, fmt.Errorf("GroupCommit: %w", err)
	}
	return groupMiddleware(db, store, handler, cfg), nil
}

// GroupTransaction is GroupCommit without duplicate detection: concurrent deliveries share one
// transaction and each is acknowledged after the one commit. It replaces Transaction in an
// at-least-once chain. It returns an error for an invalid option, or for a Deduplicate option.
func GroupTransaction(db Beginner, opts ...GroupOption) (Middleware, error) {
	cfg, err := newGroupConfig(opts)
	if err == nil && cfg.dedupOptions {
		err = errors.New("a duplicate-detection option was given, but GroupTransaction records no message ids (use GroupCommit)")
	}
	if err != nil {
		return nil, fmt.Errorf("GroupTransaction: %w", err)
	}
	return groupMiddleware(db, nil, "", cfg), nil
}

func groupMiddleware(db Beginner, store GroupStore, handler string, cfg groupConfig) Middleware {
	var txOpts *sql.TxOptions
	if cfg.txOpts != (sql.TxOptions{}) {
		txOpts = &cfg.txOpts
	}
	return func(next processor.Processor) processor.Processor {
		g := &grouper{db: db, store: store, handler: handler, cfg: cfg, txOpts: txOpts, next: next, retention: retentionOf(store)}
		return processor.Func(g.process)
	}
}

// grouper forms the groups of one chain and runs them.
type grouper struct {
	db      Beginner
	store   GroupStore // nil: no duplicate detection
	handler string
	cfg     groupConfig
	txOpts  *sql.TxOptions
	next    processor.Processor
	// retention is the store's retention, when it says, for messages older than it.
	retention time.Duration

	mu      sync.Mutex
	open    *group   // the group that members join; nil when there is none
	ready   []*group // full, or done waiting, and waiting for a transaction
	running int      // groups whose transactions run
}

type group struct {
	members []*member
	timer   *time.Timer
	waited  bool // MaxWait has passed, or there was none
}

// Member states. A member waits until its group claims it (its group starts, or hands it a
// result early) or it leaves; whichever comes first decides. A claimed member waits for its
// result.
const (
	memberWaiting int32 = iota
	memberClaimed
	memberLeft
)

type member struct {
	ctx   context.Context
	msg   *messagedata.MessageData
	key   dedup.Key
	state atomic.Int32
	done  chan memberResult // buffered: the group never blocks on a member
}

type memberResult struct {
	err         error
	panic       *processor.PanicError
	committedAt time.Time
}

func (m *member) claim() bool { return m.state.CompareAndSwap(memberWaiting, memberClaimed) }

// process is the Processor of the chain: it runs in each delivery's goroutine.
func (g *grouper) process(ctx context.Context, msg *messagedata.MessageData) error {
	m := &member{ctx: ctx, msg: msg, done: make(chan memberResult, 1)}
	if g.store != nil {
		if msg.ID == "" {
			return processor.Permanent(messagedata.ErrNoMessageID)
		}
		m.key = dedup.Key{Handler: g.handler, MessageID: msg.ID}
		if g.cfg.dedup.withTimestamp && !msg.Timestamp.IsZero() {
			m.key.Timestamp = msg.Timestamp.UnixMicro()
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("group commit: %w", err)
	}

	g.join(m)
	select {
	case r := <-m.done:
		return m.settle(r)
	case <-ctx.Done():
	}
	if m.state.CompareAndSwap(memberWaiting, memberLeft) {
		g.leave(m)
		return fmt.Errorf("group commit: left the group before processing: %w", ctx.Err())
	}
	// The group has claimed the member: its result is on the way.
	return m.settle(<-m.done)
}

// settle returns the member's result in its own goroutine: it re-raises a panic of its chain,
// and records the commit.
func (m *member) settle(r memberResult) error {
	if r.panic != nil {
		panic(r.panic)
	}
	if !r.committedAt.IsZero() {
		delivery.MarkCommitted(m.ctx, r.committedAt)
	}
	return r.err
}

// join adds m to the open group, creating it if needed, and starts what may start.
func (g *grouper) join(m *member) {
	g.mu.Lock()
	grp := g.open
	if grp == nil {
		grp = &group{waited: g.cfg.maxWait == 0}
		g.open = grp
	}
	grp.members = append(grp.members, m)
	size := len(grp.members)
	switch {
	case size >= g.cfg.maxSize:
		g.open = nil
		g.stopTimer(grp)
		g.ready = append(g.ready, grp)
	case !grp.waited && grp.timer == nil && g.running < g.cfg.concurrency:
		grp.timer = time.AfterFunc(g.cfg.maxWait, func() { g.expire(grp) })
	}
	starts := g.startLocked()
	g.mu.Unlock()
	if g.cfg.hooks.joined != nil {
		g.cfg.hooks.joined(size)
	}
	g.launch(starts)
}

// expire marks grp as done waiting and starts it if a transaction is free.
func (g *grouper) expire(grp *group) {
	g.mu.Lock()
	grp.waited = true
	grp.timer = nil
	starts := g.startLocked()
	g.mu.Unlock()
	g.launch(starts)
}

// startLocked takes the groups that may start now: ready ones first, then the open group when
// it is done waiting, or when it has waited for a transaction to be free (its members came
// while every transaction was busy). It counts them as running.
func (g *grouper) startLocked() []*group {
	var starts []*group
	for g.running < g.cfg.concurrency {
		var grp *group
		switch {
		case len(g.ready) > 0:
			grp = g.ready[0]
			g.ready = g.ready[1:]
		case g.open != nil && len(g.open.members) > 0 && g.open.waited:
			grp = g.open
			g.open = nil
			g.stopTimer(grp)
		default:
			return starts
		}
		g.running++
		starts = append(starts, grp)
	}
	// Every transaction is busy: the open group collects until one is free, and starts then
	// without waiting further.
	if g.open != nil {
		g.stopTimer(g.open)
		g.open.waited = true
	}
	return starts
}

func (g *grouper) stopTimer(grp *group) {
	if grp.timer != nil {
		grp.timer.Stop()
		grp.timer = nil
	}
}

func (g *grouper) launch(groups []*group) {
	for _, grp := range groups {
		go g.run(grp.members)
	}
}

// finished records the end of a group and starts what may start now.
func (g *grouper) finished() {
	g.mu.Lock()
	g.running--
	starts := g.startLocked()
	g.mu.Unlock()
	g.launch(starts)
}

// leave takes m, which has left, out of the group it waits in if that has not started.
func (g *grouper) leave(m *member) {
	g.mu.Lock()
	defer g.mu.Unlock()
	remove := func(grp *group) bool {
		for i, other := range grp.members {
			if other == m {
				grp.members = append(grp.members[:i], grp.members[i+1:]...)
				return true
			}
		}
		return false
	}
	if g.open != nil && remove(g.open) {
		if len(g.open.members) == 0 {
			g.stopTimer(g.open)
			g.open = nil
		}
		return
	}
	for i, grp := range g.ready {
		if remove(grp) {
			if len(grp.members) == 0 {
				g.ready = append(g.ready[:i], g.ready[i+1:]...)
			}
			return
		}
	}
}

// slot is one member's part in a running group.
type slot struct {
	m     *member
	first *slot // the first copy of the same message in the transaction, for a later copy
	ok    bool  // processed successfully in the current transaction, waiting for its commit
	final bool  // res is its result
	res   memberResult
	sent  bool
}

// finish gives s its result.
func (s *slot) finish(res memberResult) {
	s.ok = false
	s.final = true
	s.res = res
}

// groupRun is one group: its members and the transactions it takes to settle them.
type groupRun struct {
	g     *grouper
	size  int
	slots []slot
	ctx   context.Context // the group's context: ends when every member's context has ended
}

// run runs the group of members and hands every member its result.
func (g *grouper) run(members []*member) {
	defer g.finished()
	r := &groupRun{g: g}
	for _, m := range members {
		if m.claim() { // the others have left
			r.slots = append(r.slots, slot{m: m})
		}
	}
	if len(r.slots) == 0 {
		return
	}
	r.size = len(r.slots)
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	var alive atomic.Int32
	alive.Store(int32(len(r.slots)))
	for i := range r.slots {
		stop := context.AfterFunc(r.slots[i].m.ctx, func() {
			if alive.Add(-1) == 0 {
				cancel(errors.New("the context of every member has ended"))
			}
		})
		defer stop()
	}
	r.ctx = ctx

	all := make([]*slot, len(r.slots))
	for i := range r.slots {
		all[i] = &r.slots[i]
	}
	completed := false
	defer func() {
		if completed {
			return
		}
		// A bug here, or runtime.Goexit in a processor: no member may be left waiting. Each
		// member gets a panic of the group, re-raised in its own goroutine.
		res := memberResult{err: errors.New("group commit stopped before its outcome was known")}
		if v := recover(); v != nil {
			res = memberResult{panic: &processor.PanicError{Value: v, Stack: debug.Stack()}}
		}
		for _, s := range all {
			if !s.final {
				s.finish(res)
			}
			r.send(s)
		}
	}()
	r.settle(all, false)
	for _, s := range all {
		r.send(s)
	}
	completed = true
}

// step is what one transaction of a group left to do.
type step int

const (
	settled step = iota // every member of the set has its result
	rerun               // some members failed on their own: run the others again
	split               // a failure no member could be blamed for: run the set again in halves
)

// settle settles the members of set: it runs them in one transaction, and again without the
// members that fail, until every member has a result. With savepoints, each member runs under
// one, so that a failure rolls back alone.
func (r *groupRun) settle(set []*slot, savepoints bool) {
	for {
		var pending []*slot
		for _, s := range set {
			if !s.final {
				pending = append(pending, s)
			}
		}
		if len(pending) == 0 {
			return
		}
		switch r.attempt(pending, savepoints) {
		case settled:
			return
		case rerun:
			savepoints = r.g.cfg.batch == nil
		case split:
			half := len(pending) / 2
			r.settle(pending[:half], false)
			r.settle(pending[half:], false)
			return
		}
	}
}

// attempt runs set, whose members have no result yet, in one transaction.
func (r *groupRun) attempt(set []*slot, savepoints bool) step {
	for _, s := range set {
		s.first, s.ok = nil, false
	}
	tx, err := r.g.db.BeginTx(r.ctx, r.g.txOpts)
	if err != nil {
		r.failAll(set, fmt.Errorf("%w: begin transaction: %w", ErrGroupAborted, err))
		return settled
	}
	rollback := func() error {
		if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
			return fmt.Errorf("rollback: %w", err)
		}
		return nil
	}
	abort := func(cause error) step {
		if rbErr := rollback(); rbErr != nil {
			cause = errors.Join(cause, rbErr)
		}
		r.failAll(set, fmt.Errorf("%w: %w", ErrGroupAborted, cause))
		return settled
	}

	todo, refused, err := r.record(tx, set)
	if err != nil {
		return abort(err)
	}
	if refused {
		// A member beyond the retention is dead-lettered; its key, recorded with the others,
		// must not commit: run the others again without it.
		if err := rollback(); err != nil {
			return abort(err)
		}
		return rerun
	}
	if r.g.cfg.batch != nil {
		switch next, err := r.runBatch(tx, todo); {
		case err != nil:
			return abort(err)
		case next != settled:
			if err := rollback(); err != nil {
				return abort(err)
			}
			return next
		}
	} else {
		for _, s := range todo {
			if savepoints {
				if err := r.runSaved(tx, s); err != nil {
					return abort(err)
				}
				continue
			}
			if !r.runMember(tx, s) || s.ok {
				continue
			}
			// s failed on its own: roll back, and run the others again.
			if err := rollback(); err != nil {
				return abort(err)
			}
			return rerun
		}
	}
	// The ids of members that did not run (their context ended before their turn) were
	// recorded with the others: they must not commit.
	if r.g.store != nil && !savepoints {
		for _, s := range todo {
			if !s.ok {
				if err := r.g.store.Forget(r.ctx, tx, s.m.key); err != nil {
					return abort(fmt.Errorf("forget the id of message %q: %w", s.m.msg.ID, err))
				}
			}
		}
	}
	return r.commit(tx, set)
}

// record records the ids of set in tx and returns the members to process: the new ones. A
// duplicate gets its result; a later copy of a message in the set waits for the first copy's
// outcome. Without duplicate detection every member is new. refused reports a member beyond
// the retention horizon that the retention policy dead-letters: it has its result, and the
// transaction must not commit the key recorded for it.
func (r *groupRun) record(tx processor.Tx, set []*slot) (todo []*slot, refused bool, err error) {
	if r.g.store == nil {
		return set, false, nil
	}
	keys := make([]dedup.Key, len(set))
	for i, s := range set {
		keys[i] = s.m.key
	}
	ends := make([]func(error), len(set))
	for i, s := range set {
		_, ends[i] = telemetry.Child(s.m.ctx, telemetry.SpanDedup)
	}
	fresh, err := r.recordKeys(tx, keys)
	if errors.Is(err, dedup.ErrInvalidKey) {
		fresh, err = r.recordOneByOne(tx, keys, set)
	}
	for _, end := range ends {
		end(err)
	}
	if err != nil {
		return nil, false, fmt.Errorf("record %d message ids: %w", len(keys), err)
	}

	todo = make([]*slot, 0, len(set))
	firsts := make(map[dedup.Key]*slot, len(set))
	for i, s := range set {
		if s.final { // an invalid key, refused already
			continue
		}
		first, repeated := firsts[s.m.key]
		switch {
		case !repeated:
			firsts[s.m.key] = s
			if fresh[i].New() {
				if err := r.g.cfg.dedup.checkRetention(s.m.ctx, s.m.msg, fresh[i], r.g.retention); err != nil {
					s.finish(memberResult{err: err})
					refused = true
					continue
				}
				todo = append(todo, s)
			} else {
				s.finish(memberResult{err: fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, s.m.msg.ID, r.g.handler)})
				r.send(s) // at once: nothing it waits for
			}
		case first.final: // the first copy is a duplicate
			s.finish(memberResult{err: fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, s.m.msg.ID, r.g.handler)})
			r.send(s)
		default:
			s.first = first // answered with the first copy's outcome
		}
	}
	return todo, refused, nil
}

// recordKeys records keys with the store's RecordKeys when it has one, which tells renewed
// expired keys apart, and with RecordMany otherwise.
func (r *groupRun) recordKeys(tx processor.Tx, keys []dedup.Key) ([]dedup.Outcome, error) {
	if kr, ok := r.g.store.(keysRecorder); ok {
		return kr.RecordKeys(r.ctx, tx, keys)
	}
	fresh, err := r.g.store.RecordMany(r.ctx, tx, keys)
	if err != nil {
		return nil, err
	}
	out := make([]dedup.Outcome, len(fresh))
	for i, f := range fresh {
		if f {
			out[i] = dedup.Recorded
		}
	}
	return out, nil
}

// recordOneByOne records keys one statement each, after RecordMany refused the batch for an
// invalid key: a member whose key is invalid fails permanently (redelivering it cannot change
// its id), the others go on.
func (r *groupRun) recordOneByOne(tx processor.Tx, keys []dedup.Key, set []*slot) ([]dedup.Outcome, error) {
	fresh := make([]dedup.Outcome, len(keys))
	for i, k := range keys {
		f, err := r.recordKeys(tx, []dedup.Key{k})
		switch {
		case errors.Is(err, dedup.ErrInvalidKey):
			set[i].finish(memberResult{err: processor.Permanent(fmt.Errorf("record message %q: %w", set[i].m.msg.ID, err))})
			r.send(set[i])
		case err != nil:
			return nil, err
		default:
			fresh[i] = f[0]
		}
	}
	return fresh, nil
}

// runMember runs the rest of the chain for s on tx. It returns false, with s's result set,
// when s does not run because its context ended before its turn. Otherwise s.ok says whether
// it succeeded; when it did not, its failure is its result.
func (r *groupRun) runMember(tx processor.Tx, s *slot) bool {
	if err := s.m.ctx.Err(); err != nil {
		s.finish(memberResult{err: fmt.Errorf("group commit: context ended before processing: %w", err)})
		return false
	}
	pe, err := r.call(tx, s)
	if pe == nil && err == nil {
		s.ok = true
		return true
	}
	s.finish(memberResult{err: err, panic: pe})
	return true
}

// runSaved runs s under its savepoint: a failure rolls back to it and forgets s's id, and the
// others go on. It returns an error only when a statement of the group fails, which ends the
// transaction.
func (r *groupRun) runSaved(tx processor.Tx, s *slot) error {
	if _, err := tx.ExecContext(r.ctx, "SAVEPOINT "+savepointName); err != nil {
		return fmt.Errorf("set savepoint: %w", err)
	}
	if r.runMember(tx, s) && s.ok {
		return nil
	}
	if _, err := tx.ExecContext(r.ctx, "ROLLBACK TO SAVEPOINT "+savepointName); err != nil {
		return fmt.Errorf("roll back to savepoint after message %q failed: %w", s.m.msg.ID, err)
	}
	// The id was recorded before the savepoint: delete it, so that the redelivery is new.
	if r.g.store != nil {
		if err := r.g.store.Forget(r.ctx, tx, s.m.key); err != nil {
			return fmt.Errorf("forget the id of message %q: %w", s.m.msg.ID, err)
		}
	}
	return nil
}

// call runs the rest of the chain for s on tx, under s's own context, and catches a panic.
func (r *groupRun) call(tx processor.Tx, s *slot) (pe *processor.PanicError, err error) {
	defer func() {
		if v := recover(); v != nil {
			pe = asPanicError(v)
		}
	}()
	return nil, r.g.next.Process(processor.WithTx(s.m.ctx, tx), s.m.msg)
}

func asPanicError(v any) *processor.PanicError {
	if p, ok := v.(*processor.PanicError); ok {
		return p
	}
	return &processor.PanicError{Value: v, Stack: debug.Stack()}
}

// runBatch hands the members of todo to the batch processor in tx. It returns settled when the
// batch succeeded (every member that took part is ok), rerun when the batch named failing
// messages (they have their results), split when it failed without naming any, and an error
// when it failed for a reason of the database or the moment (a lost connection, a conflict, a
// canceled context), which ends the whole transaction retryably.
func (r *groupRun) runBatch(tx processor.Tx, todo []*slot) (step, error) {
	live := make([]*slot, 0, len(todo))
	for _, s := range todo {
		if err := s.m.ctx.Err(); err != nil {
			s.finish(memberResult{err: fmt.Errorf("group commit: context ended before processing: %w", err)})
			continue
		}
		live = append(live, s)
	}
	if len(live) == 0 {
		return settled, nil
	}
	msgs := make([]*messagedata.MessageData, len(live))
	for i, s := range live {
		msgs[i] = s.m.msg
	}
	pe, err := r.callBatch(tx, msgs)
	if pe == nil && err == nil {
		for _, s := range live {
			s.ok = true
		}
		return settled, nil
	}
	if pe == nil {
		if named := processor.MessageErrors(err); len(named) > 0 {
			byMsg := make(map[*messagedata.MessageData]error, len(named))
			for _, e := range named {
				byMsg[e.Message] = e.Err
			}
			blamed := false
			for _, s := range live {
				if e, ok := byMsg[s.m.msg]; ok {
					s.finish(memberResult{err: e})
					blamed = true
				}
			}
			if blamed {
				return rerun, nil
			}
			// It named only messages that are not in the batch: nobody is to blame yet.
		}
		if transient(r.ctx, err) {
			return settled, fmt.Errorf("batch processor: %w", err)
		}
	}
	if len(live) == 1 {
		live[0].finish(memberResult{err: err, panic: pe})
		return rerun, nil
	}
	return split, nil
}

// callBatch runs the batch processor on tx and catches a panic.
func (r *groupRun) callBatch(tx processor.Tx, msgs []*messagedata.MessageData) (pe *processor.PanicError, err error) {
	defer func() {
		if v := recover(); v != nil {
			pe = asPanicError(v)
		}
	}()
	return nil, r.g.cfg.batch.ProcessBatch(processor.WithTx(r.ctx, tx), msgs)
}

// transient reports whether err is a failure of the database or of the moment, not of any
// message: running the same messages again may succeed.
func transient(ctx context.Context, err error) bool {
	if ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	switch sqldb.Classify(err) {
	case sqldb.Conflict, sqldb.Connection:
		return true
	}
	return false
}

// commit commits tx for the members of set that succeeded, or rolls it back when none did, and
// sets the results. A commit that fails for a reason one of several members may have caused (a
// deferred constraint) asks for the set to be run again in halves.
func (r *groupRun) commit(tx processor.Tx, set []*slot) step {
	var ok []*slot
	for _, s := range set {
		if s.ok {
			ok = append(ok, s)
		}
	}
	if len(ok) == 0 {
		_ = tx.Rollback() // nothing to keep: the ids of failed members go with it
		r.settleCopies(set)
		return settled
	}
	ends := make([]func(error), len(ok))
	for i, s := range ok {
		var cctx context.Context
		cctx, ends[i] = telemetry.Child(s.m.ctx, telemetry.SpanCommit)
		if span := trace.SpanFromContext(cctx); span.IsRecording() {
			span.SetAttributes(AttrGroupSize.Int(r.size))
		}
	}
	err := tx.Commit()
	for _, end := range ends {
		end(err)
	}
	if err != nil {
		if c := sqldb.Classify(err); (c == sqldb.Data || c == sqldb.UniqueViolation) && len(ok) > 1 {
			for _, s := range set {
				s.ok = false
			}
			return split
		}
		err = commitError(err)
		for _, s := range ok {
			s.finish(memberResult{err: err})
		}
		r.settleCopies(set)
		return settled
	}
	at := time.Now()
	for _, s := range ok {
		s.finish(memberResult{committedAt: at})
	}
	r.settleCopies(set)
	return settled
}

// commitError is the error of a failed COMMIT: one wrapping ErrCommitOutcomeUnknown when the
// connection was lost while it was in flight (it may have committed), or ctx ended.
func commitError(err error) error {
	if sqldb.Classify(err) == sqldb.Connection || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %w", ErrCommitOutcomeUnknown, err)
	}
	return fmt.Errorf("commit: %w", err)
}

// settleCopies sets the result of the later copies of a message in set from the first copy's,
// once the first copy's is known.
func (r *groupRun) settleCopies(set []*slot) {
	for _, s := range set {
		if s.first == nil || s.final {
			continue
		}
		if !s.first.res.committedAt.IsZero() {
			s.finish(memberResult{err: fmt.Errorf("%w: id %q applied by another copy in the same group", processor.ErrDuplicate, s.m.msg.ID)})
		} else {
			s.finish(memberResult{err: fmt.Errorf("message %q: %w", s.m.msg.ID, errCopyFailed)})
		}
	}
}

// failAll gives every member of set that has no result yet cause.
func (r *groupRun) failAll(set []*slot, cause error) {
	for _, s := range set {
		if !s.final {
			s.finish(memberResult{err: cause})
		}
	}
}

// send hands s its result, once.
func (r *groupRun) send(s *slot) {
	if s.sent {
		return
	}
	s.sent = true
	res := s.res
	if !s.final || (res.err == nil && res.panic == nil && res.committedAt.IsZero()) {
		// Never reached; a nil error would be acknowledged, and nothing was committed.
		res = memberResult{err: fmt.Errorf("group commit: message %q has no outcome", s.m.msg.ID)}
	}
	s.m.done <- res
}
