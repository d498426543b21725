package onceflow

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/sqldb"
)

// This file holds the chain as a value (Chain, Stage and their edits) and the one table of the
// built-in stages (builtins), from which the canonical chains, the rules every chain keeps and
// the settings each stage reads are derived.

// StageName names a stage of a chain: a built-in stage by its role (the Stage constants), or a
// stage of one's own by the name it was given (Use, UseObserver, UseFactory). Names appear in
// logs, errors and Chain.String.
type StageName string

// The built-in stages, in the order they run, outermost first. A name says what the stage does,
// not how: which implementation runs in its place is decided by the Handler's configuration, so
// that an edit made relative to a stage holds whatever that configuration says.
const (
	// StageTracing starts the consumer span of each delivery (middleware.Tracing).
	StageTracing StageName = "tracing"
	// StageMetrics counts deliveries by outcome and times them (middleware.Metrics).
	StageMetrics StageName = "metrics"
	// StageDeadLetter publishes a message that cannot succeed to the dead-letter topic
	// (Handler.DeadLetter).
	StageDeadLetter StageName = "deadletter"
	// StageRecover turns a panic into an error (middleware.Recover).
	StageRecover StageName = "recover"
	// StageRetry runs the stages inside it again after a retryable failure (Handler.Retry).
	StageRetry StageName = "retry"
	// StageTimeout bounds each attempt (Handler.Timeout).
	StageTimeout StageName = "timeout"
	// StageTransaction is the handler's transaction: one per message, or one per group of
	// messages with group commit or a batch processor (Handler.GroupCommit,
	// Handler.BatchProcessor).
	StageTransaction StageName = "transaction"
	// StageDeduplicate is duplicate detection in the transaction, by the mode Handler.Dedup
	// chooses: a row per message id (insert-first or check-first), the last applied offset,
	// the queue's acknowledgement in the transaction, or the business tables' unique
	// constraints. Under group commit the group's transaction records the ids or offsets of
	// all its messages first; see Chain for what a stage between transaction and deduplicate
	// sees then.
	StageDeduplicate StageName = "deduplicate"
	// StageInOrder applies each ordering key's messages in sequence order (Handler.Order).
	StageInOrder StageName = "in-order"
)

// Risk names what a chain gives up when a stage that its quality of service promises is
// removed from it (Chain.Remove): the user who wants such a chain says so by passing it.
type Risk int

// The risks.
const (
	// RedeliveredForever: without the dead-letter stage, a message that cannot succeed is
	// redelivered for ever, holding back the messages behind it on some brokers.
	RedeliveredForever Risk = iota + 1
	// AppliedTwice: without duplicate detection, a message delivered again after its commit (a
	// crash or a lost acknowledgement between the commit and the ack) is applied again.
	AppliedTwice
	// AppliedOutOfOrder: without the in-order stage, the messages of an ordering key are
	// applied in the order they arrive.
	AppliedOutOfOrder
	// PartlyApplied: without the transaction, the processor's writes are not one unit: a
	// failure part-way leaves the writes made before it, and the redelivery makes them again.
	PartlyApplied
)

var riskNames = map[Risk]string{
	RedeliveredForever: "RedeliveredForever",
	AppliedTwice:       "AppliedTwice",
	AppliedOutOfOrder:  "AppliedOutOfOrder",
	PartlyApplied:      "PartlyApplied",
}

// String returns the name of r, such as "RedeliveredForever".
func (r Risk) String() string {
	if s, ok := riskNames[r]; ok {
		return s
	}
	return fmt.Sprintf("Risk(%d)", int(r))
}

// HandlerInfo is what the factory of a stage of one's own (UseFactory) knows of the handler it
// builds a middleware for.
type HandlerInfo struct {
	// Name and Topic of the handler.
	Name, Topic string
	// DB is the handler's database.
	DB *sqldb.DB
	// Dedup is the handler's duplicate-detection store; nil when its chain records no ids.
	Dedup dedup.Store
	// Logger is the router's logger, with the handler name attached.
	Logger *slog.Logger
	// MessagingSystem and ConsumerGroup describe the broker for telemetry: the OpenTelemetry
	// messaging.system and messaging.consumer.group.name (see Handler.MessagingSystem).
	MessagingSystem, ConsumerGroup string
	// Handler is the whole handler configuration.
	Handler Handler
}

// Stage is one stage of a Chain: a built-in one, or one of one's own made by Use, UseObserver or
// UseFactory. The zero Stage is not valid.
type Stage struct {
	name StageName
	// b is the built-in stage this is; nil for one of one's own.
	b *builtin
	// takes is the built-in stage whose place this one took (Chain.Replace); it keeps the
	// rules of that stage's role.
	takes StageName
	// One of these makes a stage of one's own.
	mw       middleware.Middleware
	observer middleware.Observer
	factory  func(HandlerInfo) (middleware.Middleware, error)
}

// Use returns a stage named name that runs mw. Where it goes in the chain decides what it
// sees: outside retry it runs once per delivery and sees the final outcome; between retry and
// transaction once per attempt; inside transaction in the attempt's transaction
// (processor.TxFromContext), its writes committed or rolled back with the processor's.
//
// A middleware of one's own before the transaction turns off the lane of a handler with group
// commit (a first delivery then waits for its group in a goroutine of its own); a stage that only
// watches is better made with UseObserver.
func Use(name StageName, mw middleware.Middleware) Stage { return Stage{name: name, mw: mw} }

// UseObserver returns a stage named name that runs o's Begin before the stages inside it and
// its End with their outcome. Among the outermost stages, before the dead-letter stage, it
// leaves a handler with group commit its lane: the router calls Begin and End itself, and a
// first delivery waits for its group without a goroutine of its own.
func UseObserver(name StageName, o middleware.Observer) Stage {
	return Stage{name: name, observer: o}
}

// UseFactory returns a stage named name whose middleware f builds for each handler, from what
// it knows of the handler (its name, database, logger). A nil middleware takes no part in that
// handler's chain; an error fails Router.AddHandler.
func UseFactory(name StageName, f func(HandlerInfo) (middleware.Middleware, error)) Stage {
	return Stage{name: name, factory: f}
}

// Name returns the stage's name.
func (s Stage) Name() StageName { return s.name }

// String returns the stage's name.
func (s Stage) String() string { return string(s.name) }

// role returns the built-in stage whose rules s keeps: the one it is, or the one whose place it
// took; nil for neither.
func (s Stage) role() *builtin {
	if s.b != nil {
		return s.b
	}
	if s.takes != "" {
		return builtinNamed(s.takes)
	}
	return nil
}

// Chain is the chain of stages that wraps a handler's processor, outermost first, as a value:
// QoS.Chain returns the canonical chain of a quality of service, and the edits (Before, After,
// Replace, Remove) return a new Chain, leaving the receiver as it was. Adding a stage of one's
// own is one line:
//
//	chain := onceflow.ExactlyOnce.Chain().Before(onceflow.StageRetry, onceflow.Use("tenant", tenant))
//
// Stages run in the order given: the first is the outermost, so it sees the message first and
// the outcome last. The stages not edited stay the library's: a release that changes them
// reaches the chains made by editing them.
//
// Edits never reorder the built-in stages, so the rules of the canonical order hold in every
// chain: retry runs outside the transaction, so that each attempt gets a fresh one, and the
// stages that write through the transaction (deduplicate, in-order) run inside it. A stage of
// one's own that writes through the transaction belongs inside it too, and one that runs what it
// wraps again (a retry of its own) outside it.
//
// Inside the transaction, under group commit (Handler.GroupCommit): the stages after transaction
// run for each message of the group in turn, in the group's one transaction. The group records
// the ids (or offsets) of all its messages first, with one statement, and runs them only for
// the messages that are new: a stage between transaction and deduplicate then sees no
// duplicate, where with a transaction per message it sees every delivery, duplicates included,
// before deduplicate refuses them. With a batch processor nothing may stand after transaction:
// the group hands its messages to the batch processor at once.
//
// An edit that names a stage the chain does not hold, a stage of one's own that is not valid, or
// a removal that gives up what the chain's quality of service promises without saying so, makes
// the chain invalid: Err reports it, and Router.AddHandler refuses a handler with it (as an error
// of Handler.Chain). Edits on an invalid chain do nothing, so they chain fluently and the first
// error is the one reported.
//
// The zero Chain holds nothing: a Handler whose Chain is zero takes the canonical chain of its
// QoS.
type Chain struct {
	qos    QoS
	stages []Stage
	// risks are those that Remove was given.
	risks []Risk
	err   error
}

// Chain returns the canonical chain of q, outermost first.
func (q QoS) Chain() Chain {
	if !q.Valid() {
		return Chain{err: fmt.Errorf("%s is not a quality of service (want BestEffort, AtLeastOnce, ExactlyOnce or ExactlyOnceInOrder)", q)}
	}
	c := Chain{qos: q}
	for i := range builtins {
		if slices.Contains(builtins[i].levels, q) {
			c.stages = append(c.stages, Stage{name: builtins[i].name, b: &builtins[i]})
		}
	}
	return c
}

// QoS returns the quality of service whose canonical chain c was made from.
func (c Chain) QoS() QoS { return c.qos }

// Stages returns the stages of c, outermost first.
func (c Chain) Stages() []Stage { return slices.Clone(c.stages) }

// Names returns the names of the stages of c, outermost first.
func (c Chain) Names() []StageName {
	names := make([]StageName, len(c.stages))
	for i, s := range c.stages {
		names[i] = s.name
	}
	return names
}

// String returns the names of the stages of c in the order they run, outermost first, joined
// by " -> ", such as "tracing -> metrics -> deadletter -> ...". An invalid chain says why after
// them.
func (c Chain) String() string {
	names := make([]string, len(c.stages))
	for i, s := range c.stages {
		names[i] = string(s.name)
	}
	out := strings.Join(names, " -> ")
	if err := c.Err(); err != nil {
		out += " (invalid: " + err.Error() + ")"
	}
	return out
}

// Err reports why c is not valid, or nil: the first edit that failed, or a stage that writes
// through the transaction in a chain that has none.
func (c Chain) Err() error {
	if c.err != nil {
		return c.err
	}
	if slices.ContainsFunc(c.stages, func(s Stage) bool { r := s.role(); return r != nil && r.name == StageTransaction }) {
		return nil
	}
	for _, s := range c.stages {
		if r := s.role(); r != nil && r.inTx {
			return fmt.Errorf("stage %s writes through the transaction, and the chain has no transaction stage (remove %s too, or keep %s)", s.name, s.name, StageTransaction)
		}
	}
	return nil
}

// Before returns c with the stages s inserted, in order, just outside the stage named at.
func (c Chain) Before(at StageName, s ...Stage) Chain { return c.insert("Before", at, 0, s) }

// After returns c with the stages s inserted, in order, just inside the stage named at.
func (c Chain) After(at StageName, s ...Stage) Chain { return c.insert("After", at, 1, s) }

// Replace returns c with s in place of the stage named at. A stage of one's own that replaces a
// built-in one takes over its role in the chain's rules: one that replaces transaction must run
// the transaction (and put it in the context with middleware.WithTx), and replacing a stage
// that the quality of service promises gives up nothing (the replacement keeps the promise). The
// replaced stage's settings on the Handler no longer apply, and setting them is an error.
func (c Chain) Replace(at StageName, s Stage) Chain {
	edit := fmt.Sprintf("Replace(%s, %s)", at, s.name)
	if c.err != nil {
		return c
	}
	i, err := c.index(at)
	if err == nil {
		err = c.checkNew(s, at)
	}
	if err != nil {
		return c.fail(edit, err)
	}
	old := c.stages[i]
	s.takes = old.takes
	if old.b != nil {
		s.takes = old.b.name
	}
	c.stages = slices.Clone(c.stages)
	c.stages[i] = s
	return c
}

// Remove returns c without the stage named at. Removing a stage that c's quality of service
// promises (the dead-letter stage of every level that acknowledges after processing, duplicate
// detection of ExactlyOnce and ExactlyOnceInOrder, the in-order stage of ExactlyOnceInOrder, the
// transaction of every level) makes c invalid unless accept names the Risk it gives up:
//
//	chain.Remove(onceflow.StageDeadLetter, onceflow.RedeliveredForever)
func (c Chain) Remove(at StageName, accept ...Risk) Chain {
	edit := fmt.Sprintf("Remove(%s)", at)
	if len(accept) > 0 {
		edit = fmt.Sprintf("Remove(%s, %v)", at, accept)
	}
	if c.err != nil {
		return c
	}
	i, err := c.index(at)
	if err != nil {
		return c.fail(edit, err)
	}
	role := c.stages[i].role()
	var risk Risk
	if role != nil && slices.Contains(role.levels, c.qos) {
		risk = role.risk
	}
	for _, r := range accept {
		if r != risk {
			what := "nothing that needs saying"
			if risk != 0 {
				what = "onceflow." + risk.String()
			}
			return c.fail(edit, fmt.Errorf("removing %s gives up %s, not %s", at, what, r))
		}
	}
	if risk != 0 && len(accept) == 0 {
		return c.fail(edit, fmt.Errorf("%s promises %s; pass onceflow.%s to give that up", c.qos, role.promise, risk))
	}
	c.stages = slices.Delete(slices.Clone(c.stages), i, i+1)
	if risk != 0 {
		c.risks = append(slices.Clone(c.risks), risk)
	}
	return c
}

// insert inserts s at the position of the stage named at, plus offset.
func (c Chain) insert(edit string, at StageName, offset int, s []Stage) Chain {
	names := make([]string, len(s))
	for i, st := range s {
		names[i] = string(st.name)
	}
	edit = fmt.Sprintf("%s(%s, %s)", edit, at, strings.Join(names, ", "))
	if c.err != nil {
		return c
	}
	i, err := c.index(at)
	if err != nil {
		return c.fail(edit, err)
	}
	if len(s) == 0 {
		return c.fail(edit, errors.New("no stage to insert"))
	}
	added := make([]Stage, len(s))
	for j, st := range s {
		if err := c.checkNew(st, ""); err != nil {
			return c.fail(edit, err)
		}
		if slices.ContainsFunc(s[:j], func(o Stage) bool { return o.name == st.name }) {
			return c.fail(edit, fmt.Errorf("stage %q is given twice", st.name))
		}
		st.takes = "" // a stage taken from another chain's Stages keeps no role here
		added[j] = st
	}
	c.stages = slices.Insert(slices.Clone(c.stages), i+offset, added...)
	return c
}

// index returns the position of the stage named at.
func (c Chain) index(at StageName) (int, error) {
	if i := slices.IndexFunc(c.stages, func(s Stage) bool { return s.name == at }); i >= 0 {
		return i, nil
	}
	return 0, fmt.Errorf("the chain has no stage %q (it holds %s)", at, strings.Join(stageStrings(c.stages), ", "))
}

// has reports whether c holds the stage named name.
func (c Chain) has(name StageName) bool {
	return slices.ContainsFunc(c.stages, func(s Stage) bool { return s.name == name })
}

// builtin returns the built-in stage of c called name, or nil when c does not hold it (it was
// removed, or replaced by a stage of one's own).
func (c Chain) builtin(name StageName) *builtin {
	for _, s := range c.stages {
		if s.b != nil && s.b.name == name {
			return s.b
		}
	}
	return nil
}

// checkNew reports why s, a stage of one's own, cannot go into c (in place of the stage named
// replacing, when not empty).
func (c Chain) checkNew(s Stage, replacing StageName) error {
	n := 0
	for _, set := range []bool{s.mw != nil, s.observer != nil, s.factory != nil} {
		if set {
			n++
		}
	}
	switch {
	case s.b != nil:
		return fmt.Errorf("stage %q is a built-in stage; a chain holds each once, in its canonical place", s.name)
	case s.name == "":
		return errors.New("a stage has an empty name")
	case strings.ContainsFunc(string(s.name), func(r rune) bool { return r < 0x21 || r == 0x7f }):
		return fmt.Errorf("stage name %q holds a space or a control character", s.name)
	case builtinNamed(s.name) != nil:
		return fmt.Errorf("stage name %q is the name of a built-in stage", s.name)
	case n == 0:
		return fmt.Errorf("stage %q has no middleware, observer or factory (nil, or the zero Stage)", s.name)
	case s.name != replacing && c.has(s.name):
		return fmt.Errorf("the chain holds a stage named %q already", s.name)
	}
	return nil
}

// fail returns c made invalid by edit, which failed with err.
func (c Chain) fail(edit string, err error) Chain {
	c.err = fmt.Errorf("%s: %w", edit, err)
	return c
}

func stageStrings(stages []Stage) []string {
	out := make([]string, len(stages))
	for i, s := range stages {
		out[i] = string(s.name)
	}
	return out
}

// builtin is one built-in stage: its name, the rules of its role, what it reads of a Handler,
// and how it is built. The table builtins is the one place these facts are written: the
// canonical chains, the promises of each quality of service, the rules every chain keeps, the
// settings a chain would ignore, the chain of a message that cannot be converted and the lane
// are all derived from it.
type builtin struct {
	name StageName
	// levels are the qualities of service whose canonical chain holds the stage; a chain holds
	// its stages in the order of the table.
	levels []QoS
	// risk is what a chain of one of levels gives up without the stage, and promise what the
	// quality of service promises with it, for the error of a Remove that does not say so.
	risk    Risk
	promise string
	// observes: it reports or dead-letters the delivery and touches nothing of the business
	// transaction, so it runs for a message that cannot be converted too.
	observes bool
	// inTx: it writes through the transaction, so a chain that holds it needs one.
	inTx bool
	// lane is its part in a handler's lane (lane.go), where deliveries join their group
	// without a goroutine each; the transaction's depends on whether it runs groups.
	lane laneRole
	// settings returns the fields of h that the stage reads and that h sets, by name, for the
	// error of a chain without the stage.
	settings func(h Handler) []string
	// build returns the middleware of the stage for one handler, or nil to take no part in its
	// chain; observer, for a stage that only observes, its Observer (its middleware is
	// middleware.Observe of it, and a lane calls it directly) instead.
	build    func(r *Router, e *stageEnv) (middleware.Middleware, error)
	observer func(r *Router, e *stageEnv) (middleware.Observer, error)
}

// laneRole is what a stage is to a handler's lane.
type laneRole int

const (
	// laneNone: a chain that holds it before its group transaction has no lane.
	laneNone laneRole = iota
	// laneObserve: an observer, whose Begin and End the lane calls itself.
	laneObserve
	// lanePass: it leaves a first delivery that succeeds, or is a duplicate, alone (it acts on
	// the other outcomes, which the lane sends through the chain).
	lanePass
	// laneJoin: the group transaction, which the lane joins deliveries to.
	laneJoin
)

var (
	allLevels      = []QoS{BestEffort, AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder}
	redeliveredQoS = []QoS{AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder}
	exactlyOnceQoS = []QoS{ExactlyOnce, ExactlyOnceInOrder}
)

// builtins are the built-in stages, in the order of the canonical chains, outermost first. They
// are set by init: their builders and settings read handlers' chains, which are made of them.
var builtins []builtin

func init() {
	builtins = []builtin{
		{name: StageTracing, levels: allLevels, observes: true, lane: laneObserve, observer: newTracing},
		{name: StageMetrics, levels: allLevels, observes: true, lane: laneObserve, observer: newMetrics},
		{name: StageDeadLetter, levels: redeliveredQoS, observes: true, lane: lanePass, risk: RedeliveredForever,
			promise: "that a message that cannot succeed is dead-lettered", settings: deadLetterSettings, build: newDeadLetter},
		{name: StageRecover, levels: allLevels, lane: lanePass, build: newRecover},
		{name: StageRetry, levels: redeliveredQoS, lane: lanePass, settings: retrySettings, build: newRetry},
		// The lane gives a first attempt the handler's timeout itself.
		{name: StageTimeout, levels: allLevels, lane: lanePass, settings: timeoutSettings, build: newTimeout},
		{name: StageTransaction, levels: allLevels, risk: PartlyApplied,
			promise: "that a message's writes commit or roll back together", settings: transactionSettings, build: newTransaction},
		{name: StageDeduplicate, levels: exactlyOnceQoS, inTx: true, risk: AppliedTwice,
			promise: "that a message is applied once", settings: dedupSettings, build: newDeduplicate},
		{name: StageInOrder, levels: []QoS{ExactlyOnceInOrder}, inTx: true, risk: AppliedOutOfOrder,
			promise: "that each key's messages are applied in sequence order", settings: orderSettings, build: newInOrder},
	}
}

// builtinNamed returns the built-in stage called name, or nil.
func builtinNamed(name StageName) *builtin {
	for i := range builtins {
		if builtins[i].name == name {
			return &builtins[i]
		}
	}
	return nil
}

// rejectChain returns the chain of a message of c that cannot be converted: the built-in
// stages of c that observe the delivery, always with the dead-letter stage (redelivering such
// a message cannot help).
func rejectChain(c Chain) Chain {
	out := Chain{qos: c.qos}
	for _, s := range c.stages {
		if s.b != nil && s.b.observes {
			out.stages = append(out.stages, s)
		}
	}
	if out.builtin(StageDeadLetter) == nil {
		out.stages = append(out.stages, Stage{name: StageDeadLetter, b: builtinNamed(StageDeadLetter)})
	}
	return out
}
