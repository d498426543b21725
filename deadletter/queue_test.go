package deadletter_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/deadletter"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// fixture is a dead-letter topic in a fresh SQLite queue, and its Queue.
type fixture struct {
	t *testing.T
	b *broker.Broker
	q *deadletter.Queue
}

const deadTopic = "dead"

func setup(t *testing.T, scanLimit int) *fixture {
	t.Helper()
	b, err := broker.Open(context.Background(), "sqlite://"+filepath.Join(t.TempDir(), "queue.db"), broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	q, err := deadletter.New(b, deadletter.Config{Topic: deadTopic, ScanLimit: scanLimit})
	require.NoError(t, err)
	return &fixture{t: t, b: b, q: q}
}

// deadLetter dead-letters a message of topic as handler would for reason, as the router does.
func (f *fixture) deadLetter(id, topic, handler, reason, payload string) {
	f.t.Helper()
	require.NoError(f.t, middleware.PublishDeadLetter(context.Background(), f.b.Publisher(), deadTopic, handler,
		&messagedata.MessageData{ID: id, Topic: topic, Payload: []byte(payload), Headers: map[string]string{"tenant": "7"}},
		errors.New(reason)))
}

// deadLetterAt publishes a dead letter with the headers the router writes, dead-lettered at.
func (f *fixture) deadLetterAt(id, handler, reason string, at time.Time) {
	f.t.Helper()
	m := message.NewMessage(id, []byte(`{}`))
	m.Metadata = message.Metadata{
		messagedata.HeaderDeadLetterHandler: handler,
		messagedata.HeaderDeadLetterReason:  reason,
		messagedata.HeaderDeadLetterTopic:   "orders",
		messagedata.HeaderDeadLetterTime:    at.UTC().Format(time.RFC3339Nano),
	}
	require.NoError(f.t, f.b.Publisher().Publish(deadTopic, m))
}

// waiting returns the ids waiting in topic.
func (f *fixture) waiting(topic string) []string {
	f.t.Helper()
	msgs, err := f.b.Peek(context.Background(), topic, 100)
	require.NoError(f.t, err)
	out := []string{}
	for _, m := range msgs {
		out = append(out, m.UUID)
	}
	return out
}

func ids(results []deadletter.Result) []string {
	out := []string{}
	for _, r := range results {
		out = append(out, r.Letter.ID)
	}
	return out
}

func letterIDs(letters []deadletter.Letter) []string {
	out := []string{}
	for _, l := range letters {
		out = append(out, l.ID)
	}
	return out
}

func TestReplay_GoesOnPastADeadLetterThatCannotBeReplayed(t *testing.T) {
	t.Parallel()
	f := setup(t, 0)
	var want []string
	for i := range 10 {
		id := fmt.Sprintf("m-%02d", i)
		topic := "orders"
		if i == 3 {
			topic = "no such topic *" // the broker refuses to publish there
		} else {
			want = append(want, id)
		}
		f.deadLetter(id, topic, "ledger", "account closed", `{"n":1}`)
	}

	rep, err := f.q.Replay(context.Background(), deadletter.Selection{All: true}, deadletter.ReplayOptions{})
	require.ErrorContains(t, err, `1 of 10 chosen dead letters not replayed; the first, "m-03": `)
	require.Equal(t, want, ids(rep.Done))
	require.Len(t, rep.Failed, 1)
	require.Equal(t, "m-03", rep.Failed[0].Letter.ID)
	require.Equal(t, "no such topic *", rep.Failed[0].To)
	require.ErrorContains(t, rep.Failed[0].Err, `invalid topic name: "no such topic *"`)
	require.Empty(t, rep.Kept)
	require.Equal(t, want, f.waiting("orders"), "the nine after and before it were replayed, in order")
	require.Equal(t, []string{"m-03"}, f.waiting(deadTopic), "the one that failed waits")

	// Replayed to a topic that takes it, it goes too.
	rep, err = f.q.Replay(context.Background(), deadletter.Selection{IDs: []string{"m-03"}}, deadletter.ReplayOptions{To: "orders"})
	require.NoError(t, err)
	require.Equal(t, []string{"m-03"}, ids(rep.Done))
	require.Empty(t, f.waiting(deadTopic))
}

func TestReplay_KeepsWhatCannotGoBackAndSaysWhy(t *testing.T) {
	t.Parallel()
	f := setup(t, 0)
	f.deadLetter("a", "orders", "ledger", "account closed", `{"n":1}`)
	f.deadLetter("b", "", "ledger", "account closed", `{"n":2}`) // no original topic
	// The dead-letter broker refuses c's payload: its dead letter carries none.
	require.NoError(t, middleware.PublishDeadLetter(context.Background(), payloadRefuser{f.b.Publisher()}, deadTopic, "ledger",
		&messagedata.MessageData{ID: "c", Topic: "orders", Payload: []byte(`{"n":3}`), Headers: map[string]string{}},
		errors.New("account closed")))
	f.deadLetter("d", "orders", "billing", "other", `{"n":4}`)

	rep, err := f.q.Replay(context.Background(), deadletter.Selection{All: true, Filter: deadletter.Filter{Reason: "account"}}, deadletter.ReplayOptions{})
	require.ErrorContains(t, err, `2 of 3 chosen dead letters not replayed; the first, "b": the dead letter names no original topic`)
	require.Equal(t, []string{"a"}, ids(rep.Done))
	require.Len(t, rep.Failed, 2)
	require.ErrorIs(t, rep.Failed[0].Err, deadletter.ErrNoTopic)
	require.ErrorIs(t, rep.Failed[1].Err, deadletter.ErrPayloadDropped)
	require.Equal(t, "c", rep.Failed[1].Letter.OriginalID)
	require.Equal(t, []string{"d"}, letterIDs(rep.Kept))
	require.Len(t, f.waiting(deadTopic), 3)
}

func TestReplay_ExactChoosesAsManyAsListed(t *testing.T) {
	t.Parallel()
	f := setup(t, 0)
	f.deadLetter("a", "orders", "ledger", "first", `{}`)
	f.deadLetter("b", "orders", "ledger", "first", `{}`)
	page, err := f.q.List(context.Background(), deadletter.Query{Limit: 10})
	require.NoError(t, err)
	// The same message dead-lettered again after the operator looked: it has the same id.
	f.deadLetterAt("a", "ledger", "second", time.Now())

	rep, err := f.q.Replay(context.Background(), deadletter.Selection{IDs: letterIDs(page.Letters), Exact: true}, deadletter.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b"}, ids(rep.Done))
	require.Equal(t, "first", rep.Done[0].Letter.Reason)
	require.Len(t, rep.Kept, 1)
	require.Equal(t, "second", rep.Kept[0].Reason, "the dead letter that arrived since stays")

	// Without Exact, an id chooses every dead letter that has it; an id that matches none
	// is reported.
	rep, err = f.q.Delete(context.Background(), deadletter.Selection{IDs: []string{"a", "nope"}})
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, ids(rep.Done))
	require.Equal(t, []string{"nope"}, rep.NotFound)
	require.Empty(t, f.waiting(deadTopic))
}

func TestList_FiltersAndPages(t *testing.T) {
	t.Parallel()
	f := setup(t, 0)
	base := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	for i := range 6 {
		handler := "ledger"
		if i%2 == 1 {
			handler = "billing"
		}
		reason := "permanent: account 7 is closed"
		if i == 4 {
			reason = "permanent: delivery limit reached after 10 deliveries: timeout"
		}
		f.deadLetterAt(fmt.Sprintf("m-%d", i), handler, reason, base.Add(time.Duration(i)*time.Minute))
	}
	list := func(q deadletter.Query) deadletter.Page {
		t.Helper()
		p, err := f.q.List(context.Background(), q)
		require.NoError(t, err)
		return p
	}

	p := list(deadletter.Query{Limit: 2})
	require.Equal(t, []string{"m-0", "m-1"}, letterIDs(p.Letters))
	require.True(t, p.More)
	require.True(t, p.Truncated, "an unfiltered page reads what it needs")
	require.Equal(t, 3, p.Read)

	p = list(deadletter.Query{Limit: 2, Offset: 4, Count: true})
	require.Equal(t, []string{"m-4", "m-5"}, letterIDs(p.Letters))
	require.False(t, p.More)
	require.False(t, p.Truncated)
	require.Equal(t, 6, p.Matched)

	p = list(deadletter.Query{Limit: 10, Filter: deadletter.Filter{Handler: "ledger"}})
	require.Equal(t, []string{"m-0", "m-2", "m-4"}, letterIDs(p.Letters))
	require.True(t, p.Letters[2].DeliveryLimit())
	require.False(t, p.Letters[0].DeliveryLimit())

	p = list(deadletter.Query{Limit: 1, Offset: 1, Filter: deadletter.Filter{Reason: "account 7"}})
	require.Equal(t, []string{"m-1"}, letterIDs(p.Letters))
	require.Equal(t, 5, p.Matched)
	require.True(t, p.More)

	p = list(deadletter.Query{Limit: 10, Filter: deadletter.Filter{Since: base.Add(2 * time.Minute), Until: base.Add(4 * time.Minute)}})
	require.Equal(t, []string{"m-2", "m-3"}, letterIDs(p.Letters), "from Since, before Until")

	p = list(deadletter.Query{Limit: 10, Filter: deadletter.Filter{Topic: "payments"}})
	require.Empty(t, p.Letters)
	require.Zero(t, p.Matched)

	_, err := f.q.List(context.Background(), deadletter.Query{})
	require.ErrorContains(t, err, "want an offset of 0 or more and a positive limit")
}

func TestList_StopsAtTheScanLimit(t *testing.T) {
	t.Parallel()
	f := setup(t, 3)
	for i := range 5 {
		f.deadLetterAt(fmt.Sprintf("m-%d", i), "ledger", "bad", time.Now())
	}
	p, err := f.q.List(context.Background(), deadletter.Query{Limit: 10, Filter: deadletter.Filter{Reason: "bad"}})
	require.NoError(t, err)
	require.Equal(t, 3, p.Read)
	require.Equal(t, 3, p.Matched)
	require.True(t, p.Truncated)

	rep, err := f.q.Delete(context.Background(), deadletter.Selection{All: true})
	require.NoError(t, err)
	require.Len(t, rep.Done, 3)
	require.True(t, rep.Truncated)
	require.Equal(t, []string{"m-3", "m-4"}, f.waiting(deadTopic))
}

func TestGet_ReturnsOneDeadLetterInFull(t *testing.T) {
	t.Parallel()
	f := setup(t, 0)
	f.deadLetter("a", "orders", "ledger", "permanent: account 7 is closed", `{"n":1}`)
	l, err := f.q.Get(context.Background(), "a")
	require.NoError(t, err)
	require.Equal(t, "a", l.ID)
	require.Equal(t, "a", l.MessageID())
	require.Equal(t, "orders", l.Topic)
	require.Equal(t, "ledger", l.Handler)
	require.Equal(t, "permanent: account 7 is closed", l.Reason)
	require.Equal(t, `{"n":1}`, string(l.Payload))
	require.Equal(t, 7, l.PayloadSize)
	require.Equal(t, map[string]string{"tenant": "7"}, l.Headers, "the message's own headers, without the dead-letter ones")
	require.Len(t, l.Key, 26)
	require.WithinDuration(t, time.Now(), l.Time, time.Minute)

	_, err = f.q.Get(context.Background(), "nope")
	require.ErrorIs(t, err, deadletter.ErrNoLetter)
	require.ErrorContains(t, err, `no such dead letter with id "nope" in dead for consumer group onceflow`)
}

func TestSelection_MustChooseByIDsOrAll(t *testing.T) {
	t.Parallel()
	f := setup(t, 0)
	for _, sel := range []deadletter.Selection{
		{},
		{Filter: deadletter.Filter{Reason: "x"}},
		{IDs: []string{"a"}, All: true},
		{IDs: []string{""}},
	} {
		_, err := f.q.Replay(context.Background(), sel, deadletter.ReplayOptions{})
		require.ErrorContains(t, err, "deadletter: the selection", "%+v", sel)
		_, err = f.q.Delete(context.Background(), sel)
		require.ErrorContains(t, err, "deadletter: the selection", "%+v", sel)
	}
	_, err := deadletter.New(f.b, deadletter.Config{})
	require.ErrorContains(t, err, "Config.Topic is empty")
	_, err = deadletter.New(f.b, deadletter.Config{Topic: "dead", ScanLimit: -1})
	require.ErrorContains(t, err, "Config.ScanLimit: -1 is negative")
}

// payloadRefuser refuses every message with a payload, as a dead-letter broker refuses one too
// large for it.
type payloadRefuser struct{ message.Publisher }

func (p payloadRefuser) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if len(m.Payload) > 0 {
			return errors.New("maximum payload exceeded")
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}
