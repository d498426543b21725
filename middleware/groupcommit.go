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
	// DefaultMaxGroupSize is the most members of one group. It is PostgreSQL's per-session
	// cache of subtransaction ids: every member that writes under its savepoint takes one, and
	// a transaction with more overflows the cache, which slows every snapshot taken on the
	// server while it runs.
	DefaultMaxGroupSize = 64
	// DefaultMaxGroupWait is the longest a group waits for more members after its first.
	DefaultMaxGroupWait = 5 * time.Millisecond
)

// AttrGroupSize is the number of members of the group whose transaction committed a message,
// on its onceflow.commit span.
const AttrGroupSize = attribute.Key("onceflow.group.size")

// ErrGroupAborted reports a member of a group whose own processing succeeded, or never ran,
// but whose group's transaction was rolled back: a statement of the group itself failed (the
// savepoint of another member could not be rolled back, the connection was lost, ...). Nothing
// of the member was committed; the error is retryable.
var ErrGroupAborted = errors.New("group transaction rolled back")

// errCopyFailed reports an in-group copy of a message whose first copy in the same group was
// not committed: the copy is retried rather than taken for a duplicate.
var errCopyFailed = errors.New("another copy of this message in the same group was not committed")

// savepointName is the savepoint set before each member; PostgreSQL, MySQL, MariaDB and SQLite
// share the syntax. Every member reuses the name and none is released, which saves a round
// trip per member: PostgreSQL and SQLite nest a savepoint inside the one of the same name before
// it, MySQL replaces that one, and either way ROLLBACK TO SAVEPOINT returns to the newest, the
// failing member's own. COMMIT ends them all.
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

// WithMaxGroupSize sets the most messages one group holds; a full group starts at once.
// Defaults to DefaultMaxGroupSize. 1 turns grouping off: every message has a transaction of its
// own.
func WithMaxGroupSize(n int) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.maxSize = n })
}

// WithMaxWait sets the longest a group waits for more members after its first one joined.
// Defaults to DefaultMaxGroupWait. 0 sets no timer: a group starts as soon as no other group
// of the chain is running, so the messages that arrive while one runs form the next.
func WithMaxWait(d time.Duration) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.maxWait = d })
}

// WithConcurrency tells the middleware how many deliveries can be in it at once (the router
// passes Handler.Concurrency). When no other group is running and every delivery expected in
// flight has joined the open group, waiting cannot bring another member, so the group starts
// at once instead of waiting for MaxWait. The expectation starts at n; a group that waited
// MaxWait lowers it to the deliveries that had come by then (a broker that delivers fewer
// messages at once than n, such as a queue that serialises its consumers, then costs no wait
// after the first), and it grows back, up to n, when more deliveries are in flight. Defaults to
// 0, unknown: a group waits until it is full or MaxWait passes.
func WithConcurrency(n int) GroupOption {
	return groupOptionFunc(func(c *groupConfig) { c.concurrency = n })
}

type groupConfig struct {
	maxSize      int
	maxWait      time.Duration
	concurrency  int
	txOpts       sql.TxOptions
	dedup        dedupConfig
	dedupOptions bool
	hooks        groupHooks
}

// groupHooks let tests observe the grouping; every field may be nil.
type groupHooks struct {
	// joined is called after a member joined an open group, with the group's size then.
	joined func(size int)
}

func newGroupConfig(opts []GroupOption) (groupConfig, error) {
	cfg := groupConfig{maxSize: DefaultMaxGroupSize, maxWait: DefaultMaxGroupWait}
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
	return cfg, nil
}

// GroupCommit processes concurrent deliveries in groups that share one database transaction,
// and records their message ids for handler in store in that transaction: the exactly-once
// work of Transaction and Deduplicate, with one commit for many messages. It replaces both in
// a chain; Retry stays outside it, so each attempt of a message joins a group of its own.
//
// Each message joins the open group and waits. A group starts when it holds MaxSize messages,
// when MaxWait has passed since its first message joined, or when no other group is running
// and every delivery expected in flight has joined it (see WithConcurrency). Its transaction
// then:
//
//  1. records the ids of all members with one multi-row statement (GroupStore.RecordMany);
//     a member whose id is recorded already is a duplicate and is not processed;
//  2. runs the rest of the chain for each new member in turn, in the order they joined, under a
//     SAVEPOINT of its own: a member that returns an error or panics is rolled back to its
//     savepoint and its id is deleted again, so that its redelivery is processed, while the
//     others go on (on PostgreSQL, a failed statement spoils only the savepoint);
//  3. commits once.
//
// Each message then gets its own outcome, as Transaction and Deduplicate would give it, and
// only after the transaction's outcome is known: nil once the commit succeeded (the router
// acks); its own error or panic, re-raised in its own goroutine, when it was rolled back alone;
// an error wrapping processor.ErrDuplicate for a duplicate. When a statement of the group
// itself fails (BEGIN, the id insert, a savepoint, COMMIT) every member gets an error, which
// wraps ErrCommitOutcomeUnknown when the connection was lost during COMMIT and ErrGroupAborted
// for a member whose own processing had succeeded: none is acknowledged, and each is retried.
// A group of one runs without a savepoint. A message without an id is refused with a permanent
// error wrapping messagedata.ErrNoMessageID, before it joins a group.
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
// time elsewhere (a remote call, a long query), which per-message transactions run in parallel.
// A group also holds the locks of all its members until it commits.
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
// transaction, each under its own savepoint, and each is acknowledged after the one commit. It
// replaces Transaction in an at-least-once chain. It returns an error for an invalid option,
// or for a Deduplicate option.
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
		g := &grouper{db: db, store: store, handler: handler, cfg: cfg, txOpts: txOpts, next: next, expected: cfg.concurrency}
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

	mu       sync.Mutex
	open     *group // the group that members join; nil when there is none
	inGroups int    // members in open or running groups that have no result yet
	running  int    // groups running
	// expected is how many deliveries are in flight at once, as far as the grouper can tell:
	// WithConcurrency at first, lowered to what a group found when MaxWait passed, raised
	// (up to WithConcurrency) when more members are in groups. 0 without WithConcurrency.
	expected int
}

type group struct {
	members []*member
	timer   *time.Timer
}

// Member states. A member waits until the group claims it (for its turn, or to hand it a result
// early) or it leaves; whichever comes first decides. A claimed member waits for its result.
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

	if ready := g.join(m); ready != nil {
		// This member filled the group: it runs the group in its own goroutine, and finds its
		// own result waiting when the group is done.
		g.run(ready)
	}
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

// join adds m to the open group, creating it if needed. When the group is ready to start, join
// takes it out of reach of other members and returns its members: the caller runs it.
//
// A group starts when it is full, when MaxWait has passed since its first member joined, or,
// when no other group is running, as soon as every delivery expected in flight has joined it:
// waiting longer could not bring another member. While a group runs, the next one collects
// the deliveries that arrive meanwhile instead of starting beside it with a few: the members of
// the running group come back as new deliveries once it ends.
func (g *grouper) join(m *member) []*member {
	g.mu.Lock()
	g.inGroups++
	if g.expected > 0 && g.inGroups > g.expected {
		g.expected = min(g.inGroups, g.cfg.concurrency)
	}
	grp := g.open
	if grp == nil {
		grp = &group{}
		g.open = grp
	}
	grp.members = append(grp.members, m)
	size := len(grp.members)
	var ready []*member
	switch {
	case size >= g.cfg.maxSize, g.everyoneJoinedLocked():
		ready = g.startLocked(grp)
	case grp.timer == nil && g.cfg.maxWait > 0:
		grp.timer = time.AfterFunc(g.cfg.maxWait, func() { g.expire(grp) })
	}
	g.mu.Unlock()
	if g.cfg.hooks.joined != nil {
		g.cfg.hooks.joined(size)
	}
	return ready
}

// everyoneJoinedLocked reports whether the open group should start because no other group is
// running and no other delivery is expected to join it (or, without MaxWait, because no other
// group is running).
func (g *grouper) everyoneJoinedLocked() bool {
	if g.running > 0 {
		return false
	}
	return g.cfg.maxWait == 0 || (g.expected > 0 && g.inGroups >= g.expected)
}

// expire starts grp when MaxWait has passed, unless it has started already. The members that
// came in that time are what the grouper expects from now on.
func (g *grouper) expire(grp *group) {
	g.mu.Lock()
	var ready []*member
	if g.open == grp {
		if g.expected > 0 {
			g.expected = max(g.inGroups, 1)
		}
		ready = g.startLocked(grp)
	}
	g.mu.Unlock()
	if len(ready) > 0 {
		g.run(ready)
	}
}

// startLocked takes grp out of reach of joining members and counts it as running.
func (g *grouper) startLocked(grp *group) []*member {
	g.dropLocked(grp)
	g.running++
	return grp.members
}

func (g *grouper) dropLocked(grp *group) {
	g.open = nil
	if grp.timer != nil {
		grp.timer.Stop()
	}
}

// finished records the end of a group whose members have their results, and starts the open
// group if it was waiting only for that.
func (g *grouper) finished(held int) {
	g.mu.Lock()
	g.inGroups -= held
	g.running--
	var ready []*member
	if g.open != nil && g.everyoneJoinedLocked() {
		ready = g.startLocked(g.open)
	}
	g.mu.Unlock()
	if len(ready) > 0 {
		go g.run(ready)
	}
}

// leave takes m, which has left, out of the open group if it is still there.
func (g *grouper) leave(m *member) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inGroups--
	grp := g.open
	if grp == nil {
		return
	}
	for i, other := range grp.members {
		if other == m {
			grp.members = append(grp.members[:i], grp.members[i+1:]...)
			break
		}
	}
	if len(grp.members) == 0 {
		g.dropLocked(grp)
	}
}

// slot is one member's part in a running group.
type slot struct {
	m       *member
	fresh   bool  // its id was newly recorded (always, without duplicate detection)
	first   *slot // the first copy of the same message in the group, for a later copy
	claimed bool
	ok      bool // processed successfully, waiting for the commit
	res     memberResult
	sent    bool
}

// groupRun is one group's transaction.
type groupRun struct {
	g     *grouper
	slots []slot
	ctx   context.Context // the group's context: ends when every member's context has ended
	tx    processor.Tx
	held  int // results handed out whose members still count in g.inGroups
}

// run runs the group of members in the calling goroutine and hands every member its result.
func (g *grouper) run(members []*member) {
	r := &groupRun{g: g, slots: make([]slot, len(members))}
	for i, m := range members {
		r.slots[i].m = m
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	var alive atomic.Int32
	alive.Store(int32(len(members)))
	for _, m := range members {
		stop := context.AfterFunc(m.ctx, func() {
			if alive.Add(-1) == 0 {
				cancel(errors.New("the context of every member has ended"))
			}
		})
		defer stop()
	}
	r.ctx = ctx

	completed := false
	defer func() {
		if !completed {
			// A bug here, or runtime.Goexit in a processor: no member may be left waiting.
			// Each member gets a panic of the group, re-raised in its own goroutine.
			if v := recover(); v != nil {
				r.abort(&processor.PanicError{Value: v, Stack: debug.Stack()})
			} else {
				r.abort(errors.New("group commit stopped before its outcome was known"))
			}
			r.deliver()
		}
		g.finished(r.held)
	}()
	r.execute()
	r.deliver()
	completed = true
}

func (r *groupRun) execute() {
	var err error
	r.tx, err = r.g.db.BeginTx(r.ctx, r.g.txOpts)
	if err != nil {
		r.tx = nil
		r.abort(fmt.Errorf("begin transaction: %w", err))
		return
	}
	if r.g.store != nil {
		if err := r.record(); err != nil {
			r.abort(err)
			return
		}
	} else {
		for i := range r.slots {
			r.slots[i].fresh = true
		}
	}

	var todo []*slot
	for i := range r.slots {
		if r.slots[i].fresh {
			todo = append(todo, &r.slots[i])
		}
	}
	savepoints := len(todo) > 1
	for _, s := range todo {
		if err := r.runMember(s, savepoints); err != nil {
			r.abort(err)
			return
		}
	}
	r.commit()
}

// record records the ids of the members still waiting and sorts them into new members,
// duplicates (answered at once) and later copies of a message in the group (answered with the
// first copy's outcome).
func (r *groupRun) record() error {
	var keys []dedup.Key
	var slots []*slot
	for i := range r.slots {
		s := &r.slots[i]
		if s.m.state.Load() == memberLeft {
			s.sent = true
			continue
		}
		keys = append(keys, s.m.key)
		slots = append(slots, s)
	}
	if len(keys) == 0 {
		return nil
	}
	ends := make([]func(error), len(slots))
	for i, s := range slots {
		_, ends[i] = telemetry.Child(s.m.ctx, telemetry.SpanDedup)
	}
	fresh, err := r.g.store.RecordMany(r.ctx, r.tx, keys)
	if errors.Is(err, dedup.ErrInvalidKey) {
		fresh, err = r.recordOneByOne(keys, slots)
	}
	for _, end := range ends {
		end(err)
	}
	if err != nil {
		return fmt.Errorf("record %d message ids: %w", len(keys), err)
	}

	firsts := make(map[dedup.Key]*slot, len(slots))
	for i, s := range slots {
		if s.sent { // an invalid key, refused already
			continue
		}
		s.fresh = fresh[i]
		first, repeated := firsts[s.m.key]
		switch {
		case !repeated:
			firsts[s.m.key] = s
			if !s.fresh {
				r.send(s, memberResult{err: fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, s.m.msg.ID, r.g.handler)})
			}
		case first.fresh:
			s.first = first // answered with the first copy's outcome
		default:
			r.send(s, memberResult{err: fmt.Errorf("%w: id %q recorded for handler %q", processor.ErrDuplicate, s.m.msg.ID, r.g.handler)})
		}
	}
	r.release()
	return nil
}

// recordOneByOne records keys one statement each, after RecordMany refused the batch for an
// invalid key: a member whose key is invalid fails permanently (redelivering it cannot change
// its id), the others go on.
func (r *groupRun) recordOneByOne(keys []dedup.Key, slots []*slot) ([]bool, error) {
	fresh := make([]bool, len(keys))
	for i, k := range keys {
		f, err := r.g.store.RecordMany(r.ctx, r.tx, []dedup.Key{k})
		switch {
		case errors.Is(err, dedup.ErrInvalidKey):
			r.send(slots[i], memberResult{err: processor.Permanent(fmt.Errorf("record message %q: %w", slots[i].m.msg.ID, err))})
		case err != nil:
			return nil, err
		default:
			fresh[i] = f[0]
		}
	}
	return fresh, nil
}

// runMember runs s under its savepoint, or, when s is the only member to run, without one:
// then a failure rolls the whole transaction back, as Transaction's would. It returns an error
// only when a statement of the group fails, which ends the group.
func (r *groupRun) runMember(s *slot, savepoint bool) error {
	if !r.start(s) {
		if !savepoint {
			return nil // nothing to commit: commit rolls back, and the id with it
		}
		return r.forget(s)
	}
	if savepoint {
		if _, err := r.tx.ExecContext(r.ctx, "SAVEPOINT "+savepointName); err != nil {
			return fmt.Errorf("set savepoint: %w", err)
		}
	}
	pe, err := r.call(s)
	if pe == nil && err == nil {
		s.ok = true
		return nil
	}
	s.res = memberResult{err: err, panic: pe}
	if !savepoint {
		if rbErr := r.rollback(); rbErr != nil && pe == nil {
			s.res.err = errors.Join(err, rbErr)
		}
		return nil
	}
	if _, err := r.tx.ExecContext(r.ctx, "ROLLBACK TO SAVEPOINT "+savepointName); err != nil {
		return fmt.Errorf("roll back to savepoint after message %q failed: %w", s.m.msg.ID, err)
	}
	// The id was recorded before the savepoint: delete it, so that the redelivery is new.
	return r.forget(s)
}

// start claims s for its turn. It returns false, with s's result set, when s will not run: it
// left the group, or its context ended before its turn.
func (r *groupRun) start(s *slot) bool {
	if !s.claimed {
		if !s.m.claim() {
			s.sent = true // it left; nobody waits for a result
			return false
		}
		s.claimed = true
	}
	if err := s.m.ctx.Err(); err != nil {
		s.res.err = fmt.Errorf("group commit: context ended before processing: %w", err)
		return false
	}
	return true
}

// call runs the rest of the chain for s on the group's transaction, under s's own context, and
// catches a panic.
func (r *groupRun) call(s *slot) (pe *processor.PanicError, err error) {
	defer func() {
		if v := recover(); v != nil {
			if p, ok := v.(*processor.PanicError); ok {
				pe = p
			} else {
				pe = &processor.PanicError{Value: v, Stack: debug.Stack()}
			}
		}
	}()
	return nil, r.g.next.Process(processor.WithTx(s.m.ctx, r.tx), s.m.msg)
}

// forget deletes the id of a fresh member that was not applied.
func (r *groupRun) forget(s *slot) error {
	if r.g.store == nil {
		return nil
	}
	if err := r.g.store.Forget(r.ctx, r.tx, s.m.key); err != nil {
		return fmt.Errorf("forget the id of message %q: %w", s.m.msg.ID, err)
	}
	return nil
}

// commit commits the group, or rolls it back when no member has anything to commit, and sets
// every result.
func (r *groupRun) commit() {
	var ok []*slot
	for i := range r.slots {
		if r.slots[i].ok {
			ok = append(ok, &r.slots[i])
		}
	}
	if len(ok) == 0 {
		_ = r.rollback() // nothing to keep: the ids of failed members go with it
		r.settleCopies()
		return
	}
	ends := make([]func(error), len(ok))
	for i, s := range ok {
		var cctx context.Context
		cctx, ends[i] = telemetry.Child(s.m.ctx, telemetry.SpanCommit)
		if span := trace.SpanFromContext(cctx); span.IsRecording() {
			span.SetAttributes(AttrGroupSize.Int(len(r.slots)))
		}
	}
	err := r.tx.Commit()
	for _, end := range ends {
		end(err)
	}
	r.tx = nil
	if err != nil {
		if sqldb.Classify(err) == sqldb.Connection || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("%w: %w", ErrCommitOutcomeUnknown, err)
		} else {
			err = fmt.Errorf("commit: %w", err)
		}
		for _, s := range ok {
			s.ok = false
			s.res.err = err
		}
		r.settleCopies()
		return
	}
	at := time.Now()
	for _, s := range ok {
		s.res.committedAt = at
	}
	r.settleCopies()
}

// settleCopies sets the result of the later copies of a message from the first copy's.
func (r *groupRun) settleCopies() {
	for i := range r.slots {
		s := &r.slots[i]
		if s.first == nil || s.sent {
			continue
		}
		if s.first.ok {
			s.res.err = fmt.Errorf("%w: id %q applied by another copy in the same group", processor.ErrDuplicate, s.m.msg.ID)
		} else {
			s.res.err = fmt.Errorf("message %q: %w", s.m.msg.ID, errCopyFailed)
		}
	}
}

// abort rolls the group back: every member that has no result of its own gets cause, or,
// when cause is a panic of the group itself, that panic. It may run more than once.
func (r *groupRun) abort(cause error) {
	pe, panicked := cause.(*processor.PanicError)
	if err := r.rollback(); err != nil && !panicked {
		cause = errors.Join(cause, err)
	}
	for i := range r.slots {
		s := &r.slots[i]
		s.ok = false
		switch {
		case s.sent || s.res.err != nil || s.res.panic != nil:
		case panicked:
			s.res.panic = pe
		default:
			s.res.err = fmt.Errorf("%w: %w", ErrGroupAborted, cause)
		}
	}
}

// rollback rolls back the transaction if it is still open.
func (r *groupRun) rollback() error {
	if r.tx == nil {
		return nil
	}
	err := r.tx.Rollback()
	r.tx = nil
	if err != nil && !errors.Is(err, sql.ErrTxDone) {
		return fmt.Errorf("rollback: %w", err)
	}
	return nil
}

// send hands s its result now, before the group ends.
func (r *groupRun) send(s *slot, res memberResult) {
	if s.sent {
		return
	}
	s.sent = true
	if !s.claimed && !s.m.claim() {
		return // it left
	}
	s.claimed = true
	if res.err == nil && res.panic == nil && res.committedAt.IsZero() {
		// Never reached; a nil error would be acknowledged, and nothing was committed.
		res.err = fmt.Errorf("group commit: message %q has no outcome", s.m.msg.ID)
	}
	s.m.done <- res
	r.held++
}

// deliver hands every member that has none yet its result.
func (r *groupRun) deliver() {
	for i := range r.slots {
		s := &r.slots[i]
		if !s.sent {
			r.send(s, s.res)
		}
	}
}

// release stops counting the members that have their result as in a group.
func (r *groupRun) release() {
	if r.held == 0 {
		return
	}
	r.g.mu.Lock()
	r.g.inGroups -= r.held
	r.g.mu.Unlock()
	r.held = 0
}
