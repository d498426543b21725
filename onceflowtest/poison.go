package onceflowtest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

// crashLoopGap is how long the crash-loop message is alone on its topic before the good
// messages follow, so that the first deaths it causes do not fall among them.
const crashLoopGap = 200 * time.Millisecond

// PoisonResult is what became of a run's poison messages.
type PoisonResult struct {
	// Published are the poison messages published.
	Published int `json:"published"`
	// DeadLettered are those that reached the dead-letter topic, once or more.
	DeadLettered int `json:"dead_lettered"`
	// Twice are those dead-lettered under more than one dead-letter key
	// (messagedata.HeaderDeadLetterKey): more than once.
	Twice int `json:"dead_lettered_twice"`
	// Copies are the dead letters beyond the first under one key: a consumer died between a
	// dead letter's publish and its record, and its successor published it again under the
	// same key, which a broker that deduplicates by it (the SQLite and SQL queues, NATS) drops
	// and a consumer of the dead-letter topic recognises (middleware.DeadLetter).
	Copies int `json:"dead_letter_copies,omitempty"`
	// Applied are the poison messages with an effect in the database: something of what the
	// processor wrote outlived its failure.
	Applied int `json:"applied,omitempty"`
	// Kinds says, for each poison message by name, how many dead letters it had.
	Kinds map[string]int `json:"kinds"`
	// Reasons are the dead letters' reasons, by name (the first one's).
	Reasons map[string]string `json:"reasons"`
	// Kills are the consumer processes that the crash-loop message killed.
	Kills int `json:"kills"`
	// GoodDeadLettered are good messages that reached the dead-letter topic (they count as
	// lost too: their effect is missing).
	GoodDeadLettered int `json:"good_dead_lettered"`
	// Left are the poison messages left out, by name, and why.
	Left map[string]string `json:"left_out,omitempty"`
}

// Held reports whether every poison message was dead-lettered exactly once, with nothing of
// it applied, and no good message was dead-lettered; true for nil, a run without poison.
func (p *PoisonResult) Held() bool {
	return p == nil || (p.DeadLettered == p.Published && p.Twice == 0 && p.Applied == 0 && p.GoodDeadLettered == 0)
}

// poisonSet is the poison messages of a run.
type poisonSet struct {
	res *PoisonResult
	// names are the poison messages' names, by id.
	names map[string]string
	// crash is the crash-loop message, published apart; nil when it is not published.
	crash *message.Message
	// others go among the good messages.
	others []*message.Message
}

// newPoison returns the poison messages of a run, or nil for a handler without a dead-letter
// stage or a run without poison. template is the good message whose payload the built-in ones
// carry. It publishes the message with a long id at once, to learn whether the broker carries
// it, and leaves it out with the broker's reason if not.
func newPoison(ps []Poison, h handlerInfo, runID string, template Message, pub message.Publisher, faults map[string]fault) *poisonSet {
	if !h.deadLetters || len(ps) == 0 {
		return nil
	}
	p := &poisonSet{
		res:   &PoisonResult{Kinds: map[string]int{}, Reasons: map[string]string{}, Left: map[string]string{}},
		names: map[string]string{},
	}
	for _, kind := range ps {
		// run id (12) + ".p-" + name (20) stays within the 36 bytes of the SQL queues' ids
		// but for the long id, which is meant to be too long.
		id := runID + ".p-" + kind.Name
		m := kind.Message
		if kind.fault != "" {
			m = template
			m.ID, m.Key, m.Sequence = "", "", 0
		}
		if m.ID == "" {
			m.ID = id
		}
		if kind.fault == faultLongID {
			if !h.recordsIDs {
				p.res.Left[kind.Name] = "not poison without a dedup record per id"
				continue
			}
			m.ID += "-" + strings.Repeat("x", 300)
		}
		if h.inOrder && m.Key == "" {
			// A key of its own: a poison message holds back no good one.
			m.Key, m.Sequence = runID+"-poison-"+kind.Name, 1
		}
		wm := m.toWatermill()
		if kind.fault == faultLongID {
			if err := pub.Publish(h.topic, wm); err != nil {
				// The broker's error quotes the id: shorten it.
				why := strings.ReplaceAll(err.Error(), m.ID, m.ID[:len(id)+4]+"...")
				p.res.Left[kind.Name] = "the broker does not carry it: " + why
				continue
			}
		}
		if kind.fault != "" && kind.fault != faultLongID {
			faults[m.ID] = kind.fault
		}
		p.names[m.ID] = kind.Name
		p.res.Kinds[kind.Name] = 0
		p.res.Published++
		switch kind.fault {
		case faultLongID: // published
		case faultCrashAlways:
			p.crash = wm
		default:
			p.others = append(p.others, wm)
		}
	}
	if len(p.res.Left) == 0 {
		p.res.Left = nil
	}
	return p
}

// deadLetters collects the dead letters of a run from its dead-letter topic.
type deadLetters struct {
	mu   sync.Mutex
	byID map[string][]*message.Message // by the original id
	last time.Time
	stop func()
}

// collectDeadLetters consumes topic on b until stop, keeping the dead letters that handler
// published of the messages whose ids mine says are the run's. Those of other handlers are not
// the run's: on a broker that hands every consumer group a copy of each message, another run's
// consumers of the same topic may dead-letter a copy of a message of this run.
func collectDeadLetters(ctx context.Context, b *broker.Broker, topic, handler string, mine func(id string) bool) (*deadLetters, error) {
	sub, err := b.Subscriber()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		cancel()
		_ = sub.Close()
		return nil, err
	}
	d := &deadLetters{byID: map[string][]*message.Message{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m := range ch {
			id := m.UUID
			if orig := m.Metadata.Get(messagedata.HeaderDeadLetterOriginalID); orig != "" {
				id = orig
			}
			if mine(id) && m.Metadata.Get(messagedata.HeaderDeadLetterHandler) == handler {
				d.mu.Lock()
				d.byID[id] = append(d.byID[id], m)
				d.last = time.Now()
				d.mu.Unlock()
			}
			m.Ack()
		}
	}()
	d.stop = sync.OnceFunc(func() {
		cancel()
		_ = sub.Close()
		<-done
	})
	return d, nil
}

// changed returns when the last dead letter of the run arrived.
func (d *deadLetters) changed() time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.last
}

// done reports whether every poison message of p has a dead letter.
func (d *deadLetters) done(p *poisonSet) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id := range p.names {
		if len(d.byID[id]) == 0 {
			return false
		}
	}
	return true
}

// reason returns the reason of the first dead letter of id; empty when it has none.
func (d *deadLetters) reason(id string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if ms := d.byID[id]; len(ms) > 0 {
		return ms[0].Metadata.Get(messagedata.HeaderDeadLetterReason)
	}
	return ""
}

// tally fills in p's result from the dead letters (p nil: a run without poison, whose good
// dead letters tally returns), and returns the ids of the good messages dead-lettered.
func (d *deadLetters) tally(p *poisonSet) (good []string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, ms := range d.byID {
		name, ok := "", false
		if p != nil {
			name, ok = p.names[id]
		}
		if !ok {
			good = append(good, id)
			continue
		}
		keys := map[string]bool{}
		for _, m := range ms {
			keys[m.Metadata.Get(messagedata.HeaderDeadLetterKey)] = true
		}
		p.res.Kinds[name] = len(ms)
		p.res.Reasons[name] = ms[0].Metadata.Get(messagedata.HeaderDeadLetterReason)
		p.res.DeadLettered++
		p.res.Copies += len(ms) - len(keys)
		if len(keys) > 1 {
			p.res.Twice++
		}
	}
	if p != nil {
		p.res.GoodDeadLettered = len(good)
	}
	return good
}

// String describes p in a phrase: dead-lettered exactly once / published, then what else.
func (p *PoisonResult) String() string {
	if p == nil {
		return "no poison message"
	}
	s := fmt.Sprintf("%d of %d poison messages dead-lettered exactly once", p.DeadLettered-p.Twice, p.Published)
	if p.Twice > 0 {
		s += fmt.Sprintf(", %d more than once", p.Twice)
	}
	if p.Applied > 0 {
		s += fmt.Sprintf(", %d with an effect", p.Applied)
	}
	if p.GoodDeadLettered > 0 {
		s += fmt.Sprintf(", %d good messages dead-lettered", p.GoodDeadLettered)
	}
	return s
}
