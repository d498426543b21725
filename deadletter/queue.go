package deadletter

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
)

// DefaultScanLimit is how many waiting dead letters a Queue looks at, oldest first, when
// Config.ScanLimit is zero.
const DefaultScanLimit = 10000

// Errors of the dead letters that Replay leaves in place, which a Result's Err wraps.
var (
	// ErrNoTopic: the dead letter names no topic to go back to (no
	// messagedata.HeaderDeadLetterTopic) and ReplayOptions.To is empty.
	ErrNoTopic = errors.New("the dead letter names no original topic")
	// ErrPayloadDropped: the dead-letter broker refused the message's payload, so the dead
	// letter carries none; replayed, the message would reach its handler empty.
	ErrPayloadDropped = errors.New("the dead letter carries no payload")
	// ErrNoLetter: Get found no dead letter with the id.
	ErrNoLetter = errors.New("no such dead letter")
)

// Config configures a Queue.
type Config struct {
	// Topic is the dead-letter topic. Required: the router's is onceflow.DefaultDeadLetterTopic
	// unless its Config.DeadLetterTopic names another.
	Topic string
	// ScanLimit bounds how many waiting dead letters List, Get, Replay and Delete look at,
	// oldest first. Defaults to DefaultScanLimit.
	ScanLimit int
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if c.Topic == "" {
		return errors.New("deadletter: Config.Topic is empty: name the dead-letter topic")
	}
	if c.ScanLimit < 0 {
		return fmt.Errorf("deadletter: Config.ScanLimit: %d is negative (0 selects the default)", c.ScanLimit)
	}
	return nil
}

// Queue is the dead letters that wait in one dead-letter topic for the consumer group of a
// broker. It is safe for concurrent use; what it does to the topic is what broker.Broker's
// Peek, Move and Delete do, per scheme.
type Queue struct {
	b     *broker.Broker
	topic string
	scan  int
	now   func() time.Time
}

// New returns the Queue of cfg.Topic on b, for b's consumer group.
func New(b *broker.Broker, cfg Config) (*Queue, error) {
	if b == nil {
		return nil, errors.New("deadletter: the broker is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ScanLimit == 0 {
		cfg.ScanLimit = DefaultScanLimit
	}
	return &Queue{b: b, topic: cfg.Topic, scan: cfg.ScanLimit, now: time.Now}, nil
}

// Topic returns the dead-letter topic.
func (q *Queue) Topic() string { return q.topic }

// Group returns the consumer group whose dead letters the Queue sees.
func (q *Queue) Group() string { return q.b.ConsumerGroup() }

// Broker returns the broker's URL without its password or token.
func (q *Queue) Broker() string { return q.b.String() }

// ScanLimit returns how many waiting dead letters the Queue looks at, at most.
func (q *Queue) ScanLimit() int { return q.scan }

// Query is what List reads: the dead letters Filter matches, from the Offset-th on (0 for the
// first), at most Limit of them.
type Query struct {
	Filter Filter
	Offset int
	// Limit is how many dead letters a Page holds at most; it must be positive.
	Limit int
	// Count makes List read up to the scan limit even when an unfiltered page needs fewer,
	// so that Page.Matched counts every dead letter waiting.
	Count bool
}

// Page is what List found.
type Page struct {
	// Letters are the page's dead letters, oldest first.
	Letters []Letter
	// Matched is how many of the dead letters read the filter matched, the page's among them.
	Matched int
	// Read is how many waiting dead letters List read.
	Read int
	// More says that more matching dead letters follow the page.
	More bool
	// Truncated says that List stopped reading before the end of the topic (at the scan
	// limit, or, for an unfiltered Query without Count, once it had the page): more dead
	// letters may wait than Read, and match than Matched.
	Truncated bool
}

// List returns a page of the dead letters that wait, oldest first, without consuming them.
func (q *Queue) List(ctx context.Context, query Query) (Page, error) {
	if query.Limit <= 0 || query.Offset < 0 {
		return Page{}, fmt.Errorf("deadletter: list: offset %d and limit %d: want an offset of 0 or more and a positive limit", query.Offset, query.Limit)
	}
	read := q.scan
	if query.Filter.IsZero() && !query.Count {
		read = min(q.scan, query.Offset+query.Limit+1)
	}
	msgs, err := q.b.Peek(ctx, q.topic, read)
	if err != nil {
		return Page{}, err
	}
	p := Page{Letters: []Letter{}, Read: len(msgs), Truncated: len(msgs) == read}
	for _, m := range msgs {
		l := letterOf(m)
		if !query.Filter.Match(l) {
			continue
		}
		if p.Matched >= query.Offset && len(p.Letters) < query.Limit {
			p.Letters = append(p.Letters, l)
		}
		p.Matched++
	}
	p.More = p.Matched > query.Offset+len(p.Letters)
	if p.Truncated && len(p.Letters) == query.Limit {
		p.More = true
	}
	return p, nil
}

// Get returns the oldest waiting dead letter whose ID, or OriginalID, is id, with its payload.
// It returns an error wrapping ErrNoLetter when none of the first ScanLimit has it.
func (q *Queue) Get(ctx context.Context, id string) (Letter, error) {
	msgs, err := q.b.Peek(ctx, q.topic, q.scan)
	if err != nil {
		return Letter{}, err
	}
	for _, m := range msgs {
		if l := letterOf(m); l.ID == id || l.OriginalID == id {
			return l, nil
		}
	}
	return Letter{}, fmt.Errorf("deadletter: %w with id %q in %s for consumer group %s (among the first %d)", ErrNoLetter, id, q.topic, q.Group(), q.scan)
}

// Result is what happened to one chosen dead letter.
type Result struct {
	// Letter is the dead letter, without its payload.
	Letter Letter
	// To is the topic Replay published it to, or would have.
	To string
	// Err says why it was not replayed or deleted; nil for one that was. A dead letter whose
	// replay failed waits in its place; when Err says so, its message was published as well.
	Err error
}

// Report says what Replay or Delete did, dead letter by dead letter, in their order.
type Report struct {
	// Done are the chosen dead letters replayed (published, then removed) or deleted.
	Done []Result
	// Failed are the chosen dead letters that were not, each with why.
	Failed []Result
	// Kept are the dead letters not chosen: they wait in their place.
	Kept []Letter
	// NotFound are the ids of the Selection that chose no dead letter, sorted.
	NotFound []string
	// Truncated says that ScanLimit dead letters were looked at: more may wait beyond them.
	Truncated bool
}

// ReplayOptions configure Replay.
type ReplayOptions struct {
	// To, when set, is the topic to publish every chosen dead letter to, instead of the one
	// each came from.
	To string
}

// Replay publishes each dead letter sel chooses back to the topic it came from (or opts.To)
// and, once the broker has stored that publish, removes it from the dead-letter topic. The
// others stay where they are, in their order.
//
// The replayed message keeps its original id (Letter.MessageID), payload and headers, so that
// it goes through the handler's duplicate detection again: a message that was applied already
// is acknowledged without being applied again, and replaying one twice applies it at most
// once. It loses the dead-letter headers, and gets messagedata.HeaderReplayCount (one more
// than before) and messagedata.HeaderReplayTime. A crash between the publish and the removal
// leaves the dead letter in place as well; the next Replay publishes it again, and duplicate
// detection absorbs the copy.
//
// A chosen dead letter that cannot be replayed stays in place and goes in Report.Failed with
// why: it names no topic (ErrNoTopic), carries no payload (ErrPayloadDropped), or the broker
// refused its publish or its removal. Replay goes on with the next one. It stops only when ctx
// ends or the topic cannot be read; the dead letters it did not reach are kept.
//
// The error is nil when every chosen dead letter was replayed; otherwise it says why Replay
// stopped, or how many failed and why the first one did. The report is complete either way.
func (q *Queue) Replay(ctx context.Context, sel Selection, opts ReplayOptions) (Report, error) {
	if err := sel.Validate(); err != nil {
		return Report{}, err
	}
	c := newChooser(sel)
	now := q.now()
	at := map[*message.Message]int{} // each message's place in the topic
	refused := map[*message.Message]Result{}
	res, err := q.b.Move(ctx, q.topic, q.scan, func(m *message.Message) (string, *message.Message) {
		at[m] = len(at)
		l := letterOf(m)
		if !c.choose(l) {
			return "", nil
		}
		to := cmp.Or(opts.To, l.Topic)
		switch {
		case l.PayloadDropped != "":
			refused[m] = Result{Letter: l.withoutPayload(), To: to, Err: fmt.Errorf("%w: %s", ErrPayloadDropped, l.PayloadDropped)}
			return "", nil
		case to == "":
			refused[m] = Result{Letter: l.withoutPayload(), Err: ErrNoTopic}
			return "", nil
		}
		return to, replayMessage(m, now)
	})
	rep := Report{NotFound: c.notFound(), Truncated: len(res.Moved)+len(res.Kept)+len(res.Failed) >= q.scan}
	for _, mv := range res.Moved {
		rep.Done = append(rep.Done, Result{Letter: letterOf(mv.Message).withoutPayload(), To: mv.To})
	}
	var failed []*message.Message
	for _, m := range res.Kept {
		if _, ok := refused[m]; ok {
			failed = append(failed, m)
		} else {
			rep.Kept = append(rep.Kept, letterOf(m).withoutPayload())
		}
	}
	for _, f := range res.Failed {
		l := letterOf(f.Message)
		refused[f.Message] = Result{Letter: l.withoutPayload(), To: cmp.Or(opts.To, l.Topic), Err: f.Err}
		failed = append(failed, f.Message)
	}
	slices.SortFunc(failed, func(a, b *message.Message) int { return cmp.Compare(at[a], at[b]) })
	for _, m := range failed {
		rep.Failed = append(rep.Failed, refused[m])
	}
	return rep, rep.err("replayed", err)
}

// Delete removes for good each dead letter sel chooses, publishing nothing. The others stay
// where they are, in their order. A chosen dead letter whose removal fails stays in place and
// goes in Report.Failed with why; Delete goes on with the next one. It stops only when ctx
// ends or the topic cannot be read; the dead letters it did not reach are kept.
//
// A deleted dead letter cannot be replayed: its message is gone unless its producer still has
// it. The error is nil when every chosen dead letter was deleted; otherwise it says why Delete
// stopped, or how many failed and why the first one did.
func (q *Queue) Delete(ctx context.Context, sel Selection) (Report, error) {
	if err := sel.Validate(); err != nil {
		return Report{}, err
	}
	c := newChooser(sel)
	res, err := q.b.Delete(ctx, q.topic, q.scan, func(m *message.Message) bool { return c.choose(letterOf(m)) })
	rep := Report{NotFound: c.notFound(), Truncated: len(res.Deleted)+len(res.Kept)+len(res.Failed) >= q.scan}
	for _, m := range res.Deleted {
		rep.Done = append(rep.Done, Result{Letter: letterOf(m).withoutPayload()})
	}
	for _, m := range res.Kept {
		rep.Kept = append(rep.Kept, letterOf(m).withoutPayload())
	}
	for _, f := range res.Failed {
		rep.Failed = append(rep.Failed, Result{Letter: letterOf(f.Message).withoutPayload(), Err: f.Err})
	}
	return rep, rep.err("deleted", err)
}

// err is the error of a Replay or Delete (done says which) that stopped with stop: stop, and
// how many chosen dead letters were not done and why the first was not.
func (r Report) err(done string, stop error) error {
	var errs []error
	if stop != nil {
		errs = append(errs, stop)
	}
	if n := len(r.Failed); n > 0 {
		first := r.Failed[0]
		errs = append(errs, fmt.Errorf("%d of %d chosen dead letters not %s; the first, %q: %w", n, n+len(r.Done), done, first.Letter.ID, first.Err))
	}
	return errors.Join(errs...)
}

// Choose returns the dead letters sel chooses now, oldest first, without their payloads and
// without touching them, and the ids of sel that chose none: what a Replay or Delete would act
// on, for a confirmation. To act on exactly those and not on one that arrives meanwhile, pass
// their ids with Exact set (ExactSelection).
func (q *Queue) Choose(ctx context.Context, sel Selection) (chosen []Letter, notFound []string, err error) {
	if err := sel.Validate(); err != nil {
		return nil, nil, err
	}
	msgs, err := q.b.Peek(ctx, q.topic, q.scan)
	if err != nil {
		return nil, nil, err
	}
	c := newChooser(sel)
	chosen = []Letter{}
	for _, m := range msgs {
		if l := letterOf(m); c.choose(l) {
			chosen = append(chosen, l.withoutPayload())
		}
	}
	return chosen, c.notFound(), nil
}

// ExactSelection returns the Selection of exactly letters, as Choose or List returned them:
// each of their ids chooses one dead letter, and no dead letter that arrived since.
func ExactSelection(letters []Letter) Selection {
	ids := make([]string, len(letters))
	for i, l := range letters {
		ids[i] = l.ID
	}
	return Selection{IDs: ids, Exact: true}
}
