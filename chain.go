package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// Names of the built-in interceptors, for Handler.Interceptors.
const (
	InterceptorTracing            = "tracing"
	InterceptorMetrics            = "metrics"
	InterceptorDeadLetter         = "deadletter"
	InterceptorRecover            = "recover"
	InterceptorRetry              = "retry"
	InterceptorTimeout            = "timeout"
	InterceptorTransaction        = "transaction"
	InterceptorDeduplicate        = "deduplicate"
	InterceptorNaturalIdempotency = "natural-idempotency"
	InterceptorOffsets            = "offsets"
	InterceptorAckInTransaction   = "ack-in-transaction"
	InterceptorInOrder            = "in-order"
	// InterceptorGroupCommit processes concurrent deliveries in one transaction and records
	// their ids in it (middleware.GroupCommit): it takes the place of "transaction" and
	// "deduplicate".
	InterceptorGroupCommit = "group-commit"
	// InterceptorGroupTransaction is group commit without duplicate detection
	// (middleware.GroupTransaction): it takes the place of "transaction".
	InterceptorGroupTransaction = "group-transaction"
	// InterceptorGroupOffsets is group commit with duplicate detection by position
	// (middleware.GroupOffsets): it takes the place of "transaction" and "offsets".
	InterceptorGroupOffsets = "group-offsets"
)

// HandlerInfo is what an InterceptorFactory knows of the handler it builds a middleware for.
type HandlerInfo struct {
	// Name and Topic of the handler.
	Name, Topic string
	// DB is the handler's database.
	DB *sqldb.DB
	// Dedup is the handler's duplicate-detection store.
	Dedup dedup.Store
	// Logger is the router's logger, with the handler name attached.
	Logger *slog.Logger
	// MessagingSystem and ConsumerGroup describe the broker for telemetry: the OpenTelemetry
	// messaging.system and messaging.consumer.group.name (see Handler.MessagingSystem).
	MessagingSystem, ConsumerGroup string
	// Handler is the whole handler configuration.
	Handler Handler
}

// InterceptorFactory builds the middleware an interceptor name stands for, for one handler.
type InterceptorFactory func(h HandlerInfo) (middleware.Middleware, error)

// ObserverFactory builds the observer an interceptor name stands for, for one handler
// (Router.RegisterObserver).
type ObserverFactory func(h HandlerInfo) (middleware.Observer, error)

// registered is a custom interceptor: a middleware's factory or an observer's.
type registered struct {
	interceptor InterceptorFactory
	observer    ObserverFactory
}

// builtin is one built-in interceptor: its name, what the chain rules need to know of it, and
// the factory of its middleware. The table builtins is the one place these facts are written:
// the canonical chains, the order rules, whether a chain needs a dedup store and the chain of a
// message that cannot be converted are all derived from it.
type builtin struct {
	name string
	// levels are the qualities of service whose canonical chain holds the interceptor; a chain
	// holds its interceptors in the order of the table.
	levels []QoS
	// observes: it reports or dead-letters the delivery and touches nothing of the business
	// transaction, so it runs for a message that cannot be converted too.
	observes bool
	// reruns: it runs what it wraps again, so it must come before the transaction: each
	// attempt needs a fresh one.
	reruns bool
	// tx: it runs the transaction that the interceptors after it write through.
	tx bool
	// group: it runs one transaction for a group of deliveries (group commit), so it goes with
	// no other tx interceptor; groupMarks: it also marks their messages applied itself, so it
	// goes with no marks interceptor either. A group that does not mark them takes one that
	// marksInGroup.
	group, groupMarks bool
	// marksInGroup: it marks a message applied member by member inside a group's transaction
	// (the queue's acknowledgement), so it may follow a group interceptor that does not mark.
	marksInGroup bool
	// inTx: it writes through the transaction, so it must come after the one that runs it.
	inTx bool
	// marks: it records in the transaction that the message was applied (its id, its offset,
	// the queue's acknowledgement); group commit takes its place.
	marks bool
	// recordsKeys: it records message ids in the handler's dedup store, which the router
	// creates for it.
	recordsKeys bool
	// lane is its part in a handler's lane (lane.go), where deliveries join their group
	// without a goroutine each.
	lane laneRole
	// build returns the middleware for one handler, or nil to take no part in its chain.
	build func(r *Router, h HandlerInfo) (middleware.Middleware, error)
	// observer, for an interceptor that only observes, returns its Observer for one handler:
	// its middleware is middleware.Observe of it, and a lane calls it directly. build is nil.
	observer func(r *Router, h HandlerInfo) (middleware.Observer, error)
}

// laneRole is what an interceptor is to a handler's lane.
type laneRole int

const (
	// laneNone: a chain that holds it before its group interceptor has no lane.
	laneNone laneRole = iota
	// laneObserve: an observer, whose Begin and End the lane calls itself.
	laneObserve
	// lanePass: it leaves a first delivery that succeeds, or is a duplicate, alone (it acts on
	// the other outcomes, which the lane sends through the chain).
	lanePass
	// laneJoin: the group interceptor, which the lane joins deliveries to (middleware.Joiner).
	laneJoin
)

var (
	allLevels      = []QoS{BestEffort, AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder}
	redeliveredQoS = []QoS{AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder}
	exactlyOnceQoS = []QoS{ExactlyOnce, ExactlyOnceInOrder}
)

// builtins are the built-in interceptors, in the order of the canonical chains, outermost
// first.
var builtins = []builtin{
	{name: InterceptorTracing, levels: allLevels, observes: true, lane: laneObserve, observer: newTracing},
	{name: InterceptorMetrics, levels: allLevels, observes: true, lane: laneObserve, observer: newMetrics},
	{name: InterceptorDeadLetter, levels: redeliveredQoS, observes: true, lane: lanePass, build: newDeadLetter},
	{name: InterceptorRecover, levels: allLevels, lane: lanePass, build: newRecover},
	{name: InterceptorRetry, levels: redeliveredQoS, reruns: true, lane: lanePass, build: newRetry},
	// The lane gives a first attempt the handler's timeout itself.
	{name: InterceptorTimeout, levels: allLevels, lane: lanePass, build: newTimeout},
	{name: InterceptorTransaction, levels: allLevels, tx: true, build: newTransaction},
	{name: InterceptorDeduplicate, levels: exactlyOnceQoS, inTx: true, marks: true, recordsKeys: true, build: newDeduplicate},
	{name: InterceptorNaturalIdempotency, inTx: true, build: newNaturalIdempotency},
	{name: InterceptorOffsets, inTx: true, marks: true, build: newOffsets},
	{name: InterceptorAckInTransaction, inTx: true, marks: true, marksInGroup: true, build: newAckInTransaction},
	{name: InterceptorInOrder, levels: []QoS{ExactlyOnceInOrder}, inTx: true, recordsKeys: true, build: newInOrder},
	{name: InterceptorGroupCommit, tx: true, group: true, groupMarks: true, recordsKeys: true, lane: laneJoin, build: newGroupCommit},
	{name: InterceptorGroupTransaction, tx: true, group: true, lane: laneJoin, build: newGroupTransaction},
	{name: InterceptorGroupOffsets, tx: true, group: true, groupMarks: true, lane: laneJoin, build: newGroupOffsets},
}

// builtinNamed returns the built-in interceptor called name.
func builtinNamed(name string) (builtin, bool) {
	for _, b := range builtins {
		if b.name == name {
			return b, true
		}
	}
	return builtin{}, false
}

// chainFor returns the interceptor names of the canonical chain for q, outermost first; with
// group, group commit takes the place of "transaction" and "deduplicate".
//
// Middlewares run in the order given: the first is the outermost, so it sees the message first
// and the outcome last.
func chainFor(q QoS, group bool) []string {
	names := qosChain(q)
	if !group {
		return names
	}
	// The interceptors that mark a message applied go; the transaction becomes group commit,
	// which marks the messages itself, or group transaction when there was nothing to mark.
	groupTx := InterceptorGroupTransaction
	out := make([]string, 0, len(names))
	for _, n := range names {
		if b, _ := builtinNamed(n); b.marks {
			groupTx = InterceptorGroupCommit
		}
	}
	for _, n := range names {
		switch b, _ := builtinNamed(n); {
		case b.tx:
			out = append(out, groupTx)
		case b.marks:
		default:
			out = append(out, n)
		}
	}
	return out
}

// qosChain returns the interceptor names of the canonical chain for q, outermost first.
func qosChain(q QoS) []string {
	var names []string
	for _, b := range builtins {
		if slices.Contains(b.levels, q) {
			names = append(names, b.name)
		}
	}
	return names
}

// recordsKeys reports whether a chain records message ids in a dedup store.
func recordsKeys(names []string) bool {
	return slices.ContainsFunc(names, func(n string) bool { b, _ := builtinNamed(n); return b.recordsKeys })
}

// rejectChain returns the interceptor names of the chain of a message of a chain names that
// cannot be converted: the interceptors that observe the delivery, always with "deadletter".
func rejectChain(names []string) []string {
	var outer []string
	for _, n := range names {
		if b, _ := builtinNamed(n); b.observes {
			outer = append(outer, n)
		}
	}
	if !slices.Contains(outer, InterceptorDeadLetter) {
		outer = append(outer, InterceptorDeadLetter)
	}
	return outer
}

// checkOrder enforces the two rules every chain keeps: Retry outside Transaction, so each
// attempt gets a fresh transaction, and the interceptors that write through the transaction
// inside it. A group-commit interceptor stands for the transaction, and marks the messages
// applied itself: it does not go with another transaction or with "deduplicate".
func checkOrder(names []string) error {
	pos := map[string]int{}
	for i, n := range names {
		if _, dup := pos[n]; dup {
			return fmt.Errorf("Handler.Interceptors: %q appears twice", n)
		}
		pos[n] = i
	}
	txName := InterceptorTransaction
	for _, group := range builtins {
		if _, ok := pos[group.name]; !ok || !group.group {
			continue
		}
		for _, other := range builtins {
			_, ok := pos[other.name]
			clash := other.tx || (other.marks && (group.groupMarks || !other.marksInGroup))
			if ok && other.name != group.name && clash {
				return fmt.Errorf("Handler.Interceptors: %q cannot be combined with %q (group commit runs the transaction and records the message ids itself)", group.name, other.name)
			}
		}
		txName = group.name
	}
	tx, hasTx := pos[txName]
	for _, inner := range builtins {
		if i, ok := pos[inner.name]; ok && inner.inTx && (!hasTx || i < tx) {
			return fmt.Errorf("Handler.Interceptors: %q must come after %q (it writes through the transaction)", inner.name, txName)
		}
	}
	for _, rerun := range builtins {
		if r, ok := pos[rerun.name]; ok && rerun.reruns && hasTx && r > tx {
			return fmt.Errorf("Handler.Interceptors: %q must come before %q (each attempt needs a fresh transaction)", rerun.name, txName)
		}
	}
	return nil
}

// chainNames returns the interceptor names of h's chain, outermost first: Interceptors, or
// the canonical chain of its QoS with the duplicate detection that Dedup chooses. With group
// commit, detection by position runs the group's transaction itself ("group-offsets"), and the
// acknowledgement in the transaction runs inside a group's transaction, member by member.
func chainNames(h Handler) []string {
	if len(h.Interceptors) > 0 {
		return h.Interceptors
	}
	names := chainFor(h.QoS, h.GroupCommit.Enabled || h.BatchProcessor != nil)
	dedup := h.Dedup.interceptor()
	if dedup == InterceptorDeduplicate {
		return names
	}
	names = slices.Clone(names)
	i := slices.Index(names, InterceptorGroupCommit)
	switch {
	case i < 0:
		names[slices.Index(names, InterceptorDeduplicate)] = dedup
	case dedup == InterceptorOffsets:
		names[i] = InterceptorGroupOffsets
	default:
		names[i] = InterceptorGroupTransaction
		names = slices.Insert(names, i+1, dedup)
	}
	return names
}

// checkChain checks names, the chain of h, against the order rules, and that a batch
// processor gets its batches.
func checkChain(h Handler, names []string) error {
	if err := checkOrder(names); err != nil {
		return err
	}
	if h.BatchProcessor != nil {
		if last := names[len(names)-1]; !grouped([]string{last}) {
			return fmt.Errorf("Handler.BatchProcessor: the chain must end with one of %q, which hand the batch to it (handler %q ends with %q)",
				groupNames(), h.Name, last)
		}
	}
	return nil
}

// groupNames returns the names of the interceptors that run a group's transaction.
func groupNames() []string {
	var names []string
	for _, b := range builtins {
		if b.group {
			names = append(names, b.name)
		}
	}
	return names
}

// grouped reports whether a chain runs group commit.
func grouped(names []string) bool {
	return slices.ContainsFunc(names, func(n string) bool { b, _ := builtinNamed(n); return b.group })
}

// handlerInfo is what the interceptor factories of h's chain know of it, whose dedup store is
// store and whose log lines go to logger.
func handlerInfo(h Handler, store dedup.Store, logger *slog.Logger) HandlerInfo {
	system, group := describeBroker(h)
	return HandlerInfo{
		Name:            h.Name,
		Topic:           h.Topic,
		DB:              h.DB,
		Dedup:           store,
		Logger:          logger.With("handler", h.Name),
		Handler:         h,
		MessagingSystem: system,
		ConsumerGroup:   group,
	}
}

// chains are the two chains of a handler, and its lane.
type chains struct {
	// chain is the one its messages go through; reject the one of a message that cannot be
	// converted.
	chain, reject processor.Processor
	// lane runs its first deliveries without a goroutine each, when its chain allows (nil
	// otherwise).
	lane *lane
}

// buildChains builds the two chains of the handler of info, whose interceptors are names, and
// its lane.
func buildChains(r *Router, info HandlerInfo, names []string) (chains, error) {
	links, err := buildChain(r, info, names)
	if err != nil {
		return chains{}, err
	}
	// The onceflow.process span is innermost: one per attempt, around the user's processor only.
	var inner processor.Processor = batchOnly{}
	if info.Handler.Processor != nil {
		inner = traceProcessor(info.Handler.Processor)
	}
	out := chains{chain: compose(links, inner), lane: newLane(info.Handler, links, inner)}

	// A message that cannot be converted goes through the interceptors that observe the
	// delivery, to a processor that fails permanently with the conversion error: it is traced,
	// counted and dead-lettered like any other permanent failure.
	rejectLinks, err := buildChain(r, info, rejectChain(names))
	if err != nil {
		return chains{}, err
	}
	out.reject = compose(rejectLinks, processor.Func(func(ctx context.Context, _ *messagedata.MessageData) error {
		return processor.Permanent(ctx.Value(convErrKey{}).(error))
	}))
	return out, nil
}

// link is one interceptor of a built chain.
type link struct {
	name string
	mw   middleware.Middleware
	// observer is the built-in observer mw is made of; nil for any other.
	observer middleware.Observer
}

// buildChain builds the middlewares for names, outermost first: the built-in interceptors, the
// handler's own middlewares (Handler.Middlewares) and the registered interceptors. An
// interceptor that takes no part in the handler's chain has no link.
func buildChain(r *Router, info HandlerInfo, names []string) ([]link, error) {
	var links []link
	for _, name := range names {
		reg, registered := r.interceptors[name]
		own, isOwn := info.Handler.Middlewares[name]
		var f InterceptorFactory
		var obs middleware.Observer
		observe := func(of ObserverFactory) InterceptorFactory {
			return func(h HandlerInfo) (middleware.Middleware, error) {
				o, err := of(h)
				if err != nil || o == nil {
					return nil, err
				}
				obs = o
				return middleware.Observe(o), nil
			}
		}
		switch b, builtin := builtinNamed(name); {
		case builtin && b.observer != nil:
			f = observe(func(h HandlerInfo) (middleware.Observer, error) { return b.observer(r, h) })
		case builtin:
			f = func(h HandlerInfo) (middleware.Middleware, error) { return b.build(r, h) }
		case isOwn && registered:
			return nil, fmt.Errorf("Handler.Middlewares: %q is the name of a registered interceptor too (handler %q)", name, info.Name)
		case isOwn:
			f = func(HandlerInfo) (middleware.Middleware, error) { return own, nil }
		case registered && reg.observer != nil:
			f = observe(reg.observer)
		case registered:
			f = reg.interceptor
		default:
			known := make([]string, 0, len(builtins)+len(r.interceptors))
			for _, b := range builtins {
				known = append(known, b.name)
			}
			for k := range r.interceptors {
				known = append(known, k)
			}
			slices.Sort(known)
			return nil, fmt.Errorf("Handler.Interceptors: unknown interceptor %q (known: %v)", name, known)
		}
		mw, err := f(info)
		if err != nil {
			return nil, fmt.Errorf("interceptor %q for handler %q: %w", name, info.Name, err)
		}
		if mw != nil {
			links = append(links, link{name: name, mw: mw, observer: obs})
		}
	}
	return links, nil
}

// batchOnly is the innermost processor of a handler with a BatchProcessor: the group-commit
// interceptor hands the messages to the batch processor and never calls it.
type batchOnly struct{}

func (batchOnly) Process(context.Context, *messagedata.MessageData) error {
	return errors.New("onceflow: a handler with a BatchProcessor reached its per-message processor (the chain must end with group commit)")
}

// compose returns p wrapped in the middlewares of links, the first outermost.
func compose(links []link, p processor.Processor) processor.Processor {
	if len(links) == 0 {
		return p
	}
	mws := make([]middleware.Middleware, len(links))
	for i, l := range links {
		mws[i] = l.mw
	}
	return middleware.Chain(mws[0], mws[1:]...)(p)
}
