package verify

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/ordering"
)

// crashLoopGap is how long the crash-loop message is alone on its topic before the good
// messages follow, so that the first deaths it causes do not fall among them.
const crashLoopGap = 200 * time.Millisecond

// poisonPayload is the payload of every message of a run, good or poison: the run whose
// effects table row it writes (none: the INSERT violates NOT NULL), and what its processor does.
type poisonPayload struct {
	Run   *string `json:"run"`
	N     int     `json:"n"`
	Panic bool    `json:"panic,omitempty"`
	Crash bool    `json:"crash,omitempty"`
}

// poisonPanicValue is what the panic message's processor panics with.
const poisonPanicValue = "poison message: the processor panics on it every time"

// poisonSet is the poison messages of one mode.
type poisonSet struct {
	res *PoisonResult
	ids map[string]PoisonKind
	// crash is the crash-loop message, published apart; nil when it is not published.
	crash *message.Message
	// others go among the good messages.
	others []*message.Message
}

// newPoison returns the poison messages of the mode, or nil for a mode without a dead-letter
// topic (BestEffort) or a run without poison. It publishes the message with a long id at once,
// to learn whether the broker carries it, and leaves it out with the broker's reason if not.
func newPoison(cfg Config, mode Mode, runID string, pub message.Publisher, topic string) *poisonSet {
	if mode.QoS == onceflow.BestEffort || len(cfg.Poison) == 0 {
		return nil
	}
	p := &poisonSet{
		res: &PoisonResult{Kinds: map[PoisonKind]int{}, Reasons: map[PoisonKind]string{}, Left: map[PoisonKind]string{}},
		ids: map[string]PoisonKind{},
	}
	run := fmt.Sprintf("%q", runID)
	for _, kind := range cfg.Poison {
		// run id (12) + ".poison-" + kind stays within the 36 bytes of the SQL queues' ids
		// but for the long id, which is meant to be too long.
		id := runID + ".poison-" + strings.TrimSuffix(string(kind), "-payload")
		var payload string
		switch kind {
		case PoisonDataError:
			payload = `{"run":null,"n":-1}`
		case PoisonPanic:
			payload = `{"run":` + run + `,"n":-2,"panic":true}`
		case PoisonMalformed:
			payload = `{"run":` + run + `,"n":`
		case PoisonLongID:
			if !mode.recordsIDs() {
				p.res.Left[kind] = "not poison without a dedup record per id"
				continue
			}
			id += "-" + strings.Repeat("x", 300)
			payload = `{"run":` + run + `,"n":-4}`
		case PoisonCrashLoop:
			payload = `{"run":` + run + `,"n":-5,"crash":true}`
		}
		m := message.NewMessage(id, []byte(payload))
		if mode.QoS == onceflow.ExactlyOnceInOrder {
			// A key of its own: a poison message holds back no good one.
			ordering.SetSequence(m, "poison-"+string(kind), 1)
		}
		if kind == PoisonLongID {
			if err := pub.Publish(topic, m); err != nil {
				// The broker's error quotes the id: shorten it.
				why := strings.ReplaceAll(err.Error(), id, id[:len(runID)+len(".poison-long-id-")+3]+"...")
				p.res.Left[kind] = "the broker does not carry it: " + why
				continue
			}
		}
		p.ids[id] = kind
		p.res.Kinds[kind] = 0
		p.res.Published++
		switch kind {
		case PoisonLongID: // published
		case PoisonCrashLoop:
			p.crash = m
		default:
			p.others = append(p.others, m)
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

// collectDeadLetters consumes topic on b until close, keeping the dead letters of the run
// whose id starts with runID.
func collectDeadLetters(ctx context.Context, b *broker.Broker, topic, runID string) (*deadLetters, error) {
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
			if strings.HasPrefix(id, runID) {
				d.mu.Lock()
				d.byID[id] = append(d.byID[id], m)
				d.last = time.Now()
				d.mu.Unlock()
			}
			m.Ack()
		}
	}()
	d.stop = func() {
		cancel()
		_ = sub.Close()
		<-done
	}
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
	for id := range p.ids {
		if len(d.byID[id]) == 0 {
			return false
		}
	}
	return true
}

// tally fills in p's result from the dead letters.
func (d *deadLetters) tally(p *poisonSet) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, ms := range d.byID {
		kind, ok := p.ids[id]
		if !ok {
			p.res.GoodDeadLettered++
			continue
		}
		p.res.Kinds[kind] = len(ms)
		p.res.Reasons[kind] = ms[0].Metadata.Get(messagedata.HeaderDeadLetterReason)
		p.res.DeadLettered++
		if len(ms) > 1 {
			p.res.Twice++
		}
	}
}
