package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/deadletter"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// dlqBroker is a broker scheme the dlq commands are tested on.
type dlqBroker struct {
	name string
	// url returns a broker URL for one test: a fresh database where the broker lives in one,
	// the shared server otherwise (each test uses topics of its own).
	url func(t testing.TB) string
	// cleanup removes what a test left on a shared server for its topics; nil when nothing
	// stays.
	cleanup func(t testing.TB, rawURL, group string, topics ...string)
}

func dlqBrokers() []dlqBroker {
	return []dlqBroker{
		{name: "amqp", url: testsvc.AMQPURL, cleanup: removeTopics},
		{name: "postgres", url: testsvc.PostgresSchemaURL},
		{name: "mysql", url: testsvc.MySQLDatabaseURL},
		{name: "sqlite", url: func(t testing.TB) string { return "sqlite://" + filepath.Join(t.TempDir(), "queue.db") }},
		{name: "nats", url: testsvc.NATSURL, cleanup: removeTopics},
		{name: "redis", url: testsvc.RedisURL, cleanup: removeTopics},
	}
}

// dlqTimings shortens the brokers' delays; the ack timeout stays well above any processing
// time, so that no message is redelivered for being slow and the duplicate count is exact.
const dlqTimings = "nack_delay=20ms&ack_timeout=20s&poll_interval=10ms"

// dlqFixture is one test's broker, topics, application database and running router.
type dlqFixture struct {
	t       *testing.T
	url     string // the broker URL, with the router's consumer group
	topic   string
	dlq     string
	handler string
	b       *broker.Broker
	db      *sqldb.DB
	fixed   atomic.Bool // the processor accepts payloads that are not JSON
	metrics *sdkmetric.ManualReader
}

// setupDLQ starts a router whose ExactlyOnce handler applies each message of a fresh topic
// once to an effects table, and dead-letters, on the same broker, every message whose payload
// is not JSON until fixed is set.
func setupDLQ(t *testing.T, sc dlqBroker) *dlqFixture {
	const group = "billing"
	raw := sc.url(t)
	f := &dlqFixture{
		t:       t,
		topic:   testsvc.UniqueName("orders"),
		dlq:     testsvc.UniqueName("dead"),
		handler: "ledger",
		metrics: sdkmetric.NewManualReader(),
	}
	sep := "?"
	if strings.Contains(raw, "?") {
		sep = "&"
	}
	f.url = raw + sep + "group=" + group + "&" + dlqTimings
	if sc.cleanup != nil {
		t.Cleanup(func() { sc.cleanup(t, raw, group, f.topic, f.dlq) })
	}

	ctx := context.Background()
	b, err := broker.Open(ctx, f.url, broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	f.b = b
	f.db = testsvc.SQLite(t)
	_, err = f.db.ExecContext(ctx, `CREATE TABLE effects (id TEXT NOT NULL, replays TEXT NOT NULL, dlq_headers INTEGER NOT NULL)`)
	require.NoError(t, err)

	router, err := onceflow.NewRouter(onceflow.Config{
		DeadLetterPublisher: b.Publisher(),
		DeadLetterTopic:     f.dlq,
		Logger:              slog.New(slog.NewTextHandler(io.Discard, nil)),
		MeterProvider:       sdkmetric.NewMeterProvider(sdkmetric.WithReader(f.metrics)),
		PurgeInterval:       -1,
	})
	require.NoError(t, err)
	sub, err := b.Subscriber()
	require.NoError(t, err)
	require.NoError(t, router.AddHandler(onceflow.Handler{
		Name:       f.handler,
		Topic:      f.topic,
		Subscriber: sub,
		DB:         f.db,
		QoS:        onceflow.ExactlyOnce,
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if !json.Valid(msg.Payload) && !f.fixed.Load() {
				return processor.Permanent(fmt.Errorf("payload %q is not JSON", msg.Payload))
			}
			dlqHeaders := 0
			for k := range msg.Headers {
				if strings.HasPrefix(k, "onceflow_dlq_") {
					dlqHeaders++
				}
			}
			tx, _ := processor.TxFromContext(ctx)
			_, err := tx.ExecContext(ctx, `INSERT INTO effects (id, replays, dlq_headers) VALUES (?, ?, ?)`,
				msg.ID, msg.Header(messagedata.HeaderReplayCount), dlqHeaders)
			return err
		}),
	}))
	testsvc.StartRouter(t, router)
	return f
}

// publish publishes a message with id and payload to the handler's topic.
func (f *dlqFixture) publish(id, payload string) {
	f.t.Helper()
	require.NoError(f.t, f.b.Publisher().Publish(f.topic, message.NewMessage(id, []byte(payload))))
}

// effects returns how many times each message was applied.
func (f *dlqFixture) effects() map[string]int {
	f.t.Helper()
	rows, err := f.db.Query(`SELECT id, COUNT(*) FROM effects GROUP BY id`)
	require.NoError(f.t, err)
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		require.NoError(f.t, rows.Scan(&id, &n))
		out[id] = n
	}
	require.NoError(f.t, rows.Err())
	return out
}

// waitApplied waits until the effects are exactly want.
func (f *dlqFixture) waitApplied(want map[string]int) {
	f.t.Helper()
	testsvc.Eventually(f.t, 30*time.Second, func() bool {
		got := f.effects()
		for id, n := range want {
			if got[id] != n {
				return false
			}
		}
		return len(got) == len(want)
	}, "effects never became %v (last: %v)", want, f.effects())
}

// waitDeadLetters waits until n dead letters wait in the dead-letter topic.
func (f *dlqFixture) waitDeadLetters(n int) {
	f.t.Helper()
	const wait = 30 * time.Second
	for deadline := time.Now().Add(wait); ; time.Sleep(10 * time.Millisecond) {
		msgs, err := f.b.Peek(context.Background(), f.dlq, n+1)
		require.NoError(f.t, err)
		if len(msgs) == n {
			return
		}
		if time.Now().After(deadline) {
			var why string
			if strings.HasPrefix(f.url, "postgres") {
				why = "; " + testsvc.PostgresOldTransactions(f.t, 5*time.Second)
			}
			f.t.Fatalf("after %s: %d dead letters never waited in %s (%d do)%s", wait, n, f.dlq, len(msgs), why)
		}
	}
}

// duplicates returns how many deliveries the handler acknowledged as duplicates.
func (f *dlqFixture) duplicates() int64 {
	f.t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(f.t, f.metrics.Collect(context.Background(), &rm))
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != telemetry.MetricMessages {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			require.True(f.t, ok, "%s is a sum", m.Name)
			for _, dp := range sum.DataPoints {
				if v, ok := dp.Attributes.Value(telemetry.AttrOutcome); ok && v.AsString() == string(processor.Duplicate) {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// run runs the onceflow command with args against the fixture's broker and dead-letter topic.
func (f *dlqFixture) run(args ...string) (string, error) {
	f.t.Helper()
	return run(f.t, append(args, "--broker", f.url, "--topic", f.dlq)...)
}

// list runs dlq list --json and decodes its report.
func (f *dlqFixture) list() listReport {
	f.t.Helper()
	out, err := f.run("dlq", "list", "--json")
	require.NoError(f.t, err, out)
	var rep listReport
	require.NoError(f.t, json.Unmarshal([]byte(out), &rep), out)
	return rep
}

// replay runs dlq replay --json with args and decodes its report.
func (f *dlqFixture) replay(args ...string) replayReport {
	f.t.Helper()
	out, err := f.run(append([]string{"dlq", "replay", "--json"}, args...)...)
	require.NoError(f.t, err, out)
	var rep replayReport
	require.NoError(f.t, json.Unmarshal([]byte(out), &rep), out)
	return rep
}

func ids(dls []deadLetter) []string {
	out := make([]string, len(dls))
	for i, d := range dls {
		out[i] = d.ID
	}
	return out
}

func TestDLQ_ListShowsAndReplayPutsBackDeadLettersExactlyOnce(t *testing.T) {
	t.Parallel()
	for _, sc := range dlqBrokers() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			f := setupDLQ(t, sc)
			// Subscribers with many deliveries in flight process messages in any order: the
			// second bad message comes once the first is dead-lettered, so that the dead
			// letters wait in a known order.
			f.publish("good-1", `{"n": 1}`)
			f.publish("bad-1", `not json 1`)
			f.waitDeadLetters(1)
			f.publish("bad-2", `not json, 2`)
			f.publish("good-2", `{"n": 2}`)
			f.waitApplied(map[string]int{"good-1": 1, "good-2": 1})
			f.waitDeadLetters(2)

			// list shows both, with why, where and when; listing again finds them again.
			rep := f.list()
			require.Equal(t, []string{"bad-1", "bad-2"}, ids(rep.DeadLetters))
			require.Equal(t, 2, rep.Count)
			require.False(t, rep.More)
			require.Equal(t, f.dlq, rep.Topic)
			require.Equal(t, "billing", rep.Group)
			for i, d := range rep.DeadLetters {
				require.Equal(t, f.topic, d.Topic)
				require.Equal(t, f.handler, d.Handler)
				require.Equal(t, 1, d.Attempt)
				require.Contains(t, d.Reason, "is not JSON")
				require.Equal(t, []int{len("not json 1"), len("not json, 2")}[i], d.PayloadSize)
				require.Nil(t, d.Payload, "payloads only with --payload")
				_, err := time.Parse(time.RFC3339Nano, d.Time)
				require.NoError(t, err, "time %q", d.Time)
			}
			require.Equal(t, ids(rep.DeadLetters), ids(f.list().DeadLetters), "listing consumed nothing")

			table, err := f.run("dlq", "list", "--payload")
			require.NoError(t, err)
			lines := strings.Split(strings.TrimSpace(table), "\n")
			require.Len(t, lines, 8, table)
			require.Regexp(t, `^COUNT\s+HANDLER\s+REASON$`, lines[0])
			require.Regexp(t, `^1\s+ledger\s+permanent: payload "not json 1" is not JSON$`, lines[1])
			require.Regexp(t, `^1\s+ledger\s+permanent: payload "not json, 2" is not JSON$`, lines[2])
			require.Empty(t, lines[3])
			require.Regexp(t, `^ID\s+DEAD-LETTERED\s+TOPIC\s+HANDLER\s+DELIVERY\s+ATTEMPT\s+SIZE\s+REASON\s+PAYLOAD$`, lines[4])
			require.Regexp(t, `^bad-1\s+\S+\s+`+f.topic+`\s+ledger\s+1\s+1\s+10\s+permanent: payload "not json 1" is not JSON\s+"not json 1"$`, lines[5])
			require.Equal(t, "2 dead letters in "+f.dlq+" for consumer group billing on "+f.b.String(), lines[7])

			// Replay one: it goes back to its topic and is applied once (the processor is fixed
			// now); the other stays.
			f.fixed.Store(true)
			rr := f.replay("--id", "bad-1")
			require.Equal(t, []replayed{{ID: "bad-1", To: f.topic, Handler: f.handler, Deliveries: 1, Attempt: 1, Reason: rep.DeadLetters[0].Reason, Replays: 1}}, rr.Replayed)
			require.Equal(t, []kept{{ID: "bad-2", Topic: f.topic, Handler: f.handler, Reason: rep.DeadLetters[1].Reason}}, rr.Kept)
			require.Empty(t, rr.NotFound)
			require.Equal(t, []string{"bad-2"}, ids(f.list().DeadLetters))
			f.waitApplied(map[string]int{"good-1": 1, "good-2": 1, "bad-1": 1})

			// The same message dead-lettered again after its replay (it carries its replay
			// count, so its dead letter has a key of its own) and replayed again:
			// deduplication acknowledges it without applying it.
			require.NoError(t, middleware.PublishDeadLetter(context.Background(), f.b.Publisher(), f.dlq, f.handler,
				&messagedata.MessageData{ID: "bad-1", Topic: f.topic, Payload: []byte("not json 1"),
					Headers: map[string]string{messagedata.HeaderReplayCount: "1"}},
				errors.New("dead-lettered again by hand")))
			f.waitDeadLetters(2)
			rr = f.replay("--id", "bad-1")
			require.Equal(t, []string{"bad-1"}, []string{rr.Replayed[0].ID})
			require.Len(t, rr.Replayed, 1)
			testsvc.Eventually(t, 30*time.Second, func() bool { return f.duplicates() == 1 }, "the second replay was never acked as a duplicate")

			// An id that is not there: nothing happens, and the command says so.
			out, err := f.run("dlq", "replay", "--id", "nope")
			require.ErrorContains(t, err, `no dead letter with id "nope"`)
			require.Contains(t, out, "replayed 0 dead letters, kept 1 in "+f.dlq)

			// Replay all: the topic is empty, and every message was applied exactly once.
			rr = f.replay("--all")
			require.Equal(t, []string{"bad-2"}, []string{rr.Replayed[0].ID})
			require.Len(t, rr.Replayed, 1)
			require.Empty(t, rr.Kept)
			empty := f.list()
			require.Zero(t, empty.Count)
			require.Empty(t, empty.DeadLetters)
			f.waitApplied(map[string]int{"good-1": 1, "good-2": 1, "bad-1": 1, "bad-2": 1})
			require.EqualValues(t, 1, f.duplicates())
			var replays []string
			require.NoError(t, f.db.Select(&replays, `SELECT id || ':' || replays || ':' || dlq_headers FROM effects ORDER BY id`))
			require.Equal(t, []string{"bad-1:1:0", "bad-2:1:0", "good-1::0", "good-2::0"}, replays,
				"a replayed message carries its replay count and no dead-letter headers")
			out, err = f.run("dlq", "list")
			require.NoError(t, err)
			require.Equal(t, "no dead letters in "+f.dlq+" for consumer group billing on "+f.b.String()+"\n", out)
		})
	}
}

func TestDLQ_CommandsSayWhatIsMissing(t *testing.T) {
	t.Setenv(envBroker, "")
	_, err := run(t, "dlq", "list")
	require.ErrorContains(t, err, "pass --broker URL or set ONCEFLOW_BROKER")
	url := "sqlite://" + filepath.Join(t.TempDir(), "queue.db")
	for _, args := range [][]string{
		{}, {"--all", "--id", "x"}, {"--reason", "x", "--id", "y"}, {"--all", "--reason", "x"},
	} {
		_, err = run(t, append([]string{"dlq", "replay", "--broker", url}, args...)...)
		require.ErrorContains(t, err, "choose the dead letters to replay: --id ID (repeatable), a filter (--reason TEXT, ", "%v", args)
	}
	_, err = run(t, "dlq", "replay", "--broker", url, "--reason", "")
	require.ErrorContains(t, err, "--reason is empty")
	_, err = run(t, "dlq", "replay", "--broker", url, "--since", "yesterday")
	require.ErrorContains(t, err, `--since "yesterday": want an RFC 3339 time`)
	_, err = run(t, "dlq", "delete", "--broker", url, "--yes")
	require.ErrorContains(t, err, "choose the dead letters to delete: --id ID (repeatable), a filter (--reason TEXT, ")
	_, err = run(t, "dlq", "list", "--broker", "mem://x")
	require.ErrorIs(t, err, errors.ErrUnsupported)
	_, err = run(t, "dlq", "list", "--broker", url, "--limit", "0")
	require.ErrorContains(t, err, "--limit 0")
}

func TestDLQ_GroupFlagOverridesTheURL(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "queue.db")
	q, err := sqlitequeue.Open(context.Background(), path, sqlitequeue.Config{})
	require.NoError(t, err)
	url := "sqlite://" + path + "?group=billing"
	_, err = run(t, "dlq", "list", "--broker", url, "--group", "shipping")
	require.ErrorIs(t, err, broker.ErrNotFound, "no dead letter was ever published: the topic does not exist")
	require.ErrorContains(t, err, `no dead-letter topic "`+onceflow.DefaultDeadLetterTopic+`" for consumer group "shipping"`)

	require.NoError(t, middleware.PublishDeadLetter(context.Background(), q.Publisher(), onceflow.DefaultDeadLetterTopic, "ledger",
		&messagedata.MessageData{ID: "pay-1", Topic: "payments", Payload: []byte(`{}`), Headers: map[string]string{}}, errors.New("refused")))
	require.NoError(t, q.Close())
	out, err := run(t, "dlq", "list", "--broker", url, "--group", "shipping", "--json")
	require.NoError(t, err)
	var rep listReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Equal(t, "shipping", rep.Group)
	require.Equal(t, onceflow.DefaultDeadLetterTopic, rep.Topic)
	require.Len(t, rep.DeadLetters, 1, "the group flag, not the URL's, reads the topic")
}

// removeTopics removes what a test left on a shared server for its topics.
func removeTopics(t testing.TB, rawURL, group string, topics ...string) {
	testsvc.RemoveTopics(t, rawURL, []string{group}, topics...)
}

// letters is one test's broker, in consumer group billing, and fresh topics, without a router:
// the test publishes its dead letters itself, as the router's DeadLetter middleware does.
type letters struct {
	t     *testing.T
	sc    dlqBroker
	url   string
	topic string // the topic the dead letters came from
	dlq   string
	b     *broker.Broker
}

func setupLetters(t *testing.T, sc dlqBroker) *letters {
	const group = "billing"
	raw := sc.url(t)
	l := &letters{t: t, sc: sc, topic: testsvc.UniqueName("orders"), dlq: testsvc.UniqueName("dead")}
	sep := "?"
	if strings.Contains(raw, "?") {
		sep = "&"
	}
	l.url = raw + sep + "group=" + group
	if sc.cleanup != nil {
		t.Cleanup(func() { sc.cleanup(t, raw, group, l.topic, l.dlq) })
	}
	b, err := broker.Open(context.Background(), l.url, broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	l.b = b
	return l
}

// deadLetter dead-letters a message of the fixture's topic as handler would for reason.
func (l *letters) deadLetter(id, handler, reason, payload string) {
	l.t.Helper()
	require.NoError(l.t, middleware.PublishDeadLetter(context.Background(), l.b.Publisher(), l.dlq, handler,
		&messagedata.MessageData{ID: id, Topic: l.topic, Payload: []byte(payload), Headers: map[string]string{}},
		errors.New(reason)))
}

// run runs the onceflow command with args against the fixture's broker and dead-letter topic.
func (l *letters) run(args ...string) (string, error) {
	l.t.Helper()
	return run(l.t, append(args, "--broker", l.url, "--topic", l.dlq)...)
}

// waiting returns the ids waiting in topic for the fixture's group.
func (l *letters) waiting(topic string) []string {
	l.t.Helper()
	msgs, err := l.b.Peek(context.Background(), topic, 100)
	require.NoError(l.t, err)
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}

// requireWaiting asserts that the messages waiting on topic are want, in order. On AMQP a
// message that a command has just read comes back to its queue a moment after the command
// closed its channel: the check polls until the list is want, for up to 10 s.
func (l *letters) requireWaiting(topic string, want []string, msgAndArgs ...any) {
	l.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	got := l.waiting(topic)
	for !slices.Equal(got, want) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
		got = l.waiting(topic)
	}
	require.Equal(l.t, want, got, msgAndArgs...)
}

// requireTerminalSafe checks that out holds nothing a terminal interprets but newlines, and
// nothing text/tabwriter treats as a cell boundary or an escape.
func requireTerminalSafe(t *testing.T, out string) {
	t.Helper()
	require.True(t, utf8.ValidString(out), "output is not UTF-8: %q", out)
	for _, r := range out {
		require.True(t, r == '\n' || unicode.IsPrint(r), "output holds %U: %q", r, out)
	}
}

func TestDLQ_ListGroupsTheDeadLettersByHandlerAndReason(t *testing.T) {
	t.Parallel()
	for _, sc := range dlqBrokers() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			l := setupLetters(t, sc)
			for _, d := range []struct{ id, handler, reason string }{
				{"a", "ledger", "account 7 is closed"},
				{"b", "ledger", "payload is not JSON"},
				{"c", "billing", "account 7 is closed"},
				{"d", "ledger", "account 7 is closed"},
				{"e", "ledger", "account 7 is closed"},
			} {
				l.deadLetter(d.id, d.handler, d.reason, "{}")
			}
			l.waitFor(5)

			out, err := l.run("dlq", "list", "--json")
			require.NoError(t, err)
			var rep listReport
			require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
			require.Equal(t, []letterGroup{
				{Handler: "ledger", Reason: "account 7 is closed", Count: 3, IDs: []string{"a", "d", "e"}},
				{Handler: "ledger", Reason: "payload is not JSON", Count: 1, IDs: []string{"b"}},
				{Handler: "billing", Reason: "account 7 is closed", Count: 1, IDs: []string{"c"}},
			}, rep.Groups)
			require.Equal(t, []string{"a", "b", "c", "d", "e"}, ids(rep.DeadLetters))

			out, err = l.run("dlq", "list")
			require.NoError(t, err)
			lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
			require.Equal(t, []string{
				"COUNT  HANDLER  REASON",
				"3      ledger   account 7 is closed",
				"1      ledger   payload is not JSON",
				"1      billing  account 7 is closed",
				"",
			}, lines[:5])
			require.Regexp(t, `^ID\s+DEAD-LETTERED\s+TOPIC\s+HANDLER\s+DELIVERY\s+ATTEMPT\s+SIZE\s+REASON$`, lines[5])
			require.Len(t, lines, 5+1+5+1)
			require.Equal(t, "5 dead letters in "+l.dlq+" for consumer group billing on "+l.b.String(), lines[11])

			// One dead letter is one, and the counts are of those listed.
			out, err = l.run("dlq", "list", "--limit", "1")
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(out, "COUNT  HANDLER  REASON\n1      ledger   account 7 is closed\n\n"), out)
			require.True(t, strings.HasSuffix(out, "\n1 dead letter in "+l.dlq+" for consumer group billing on "+l.b.String()+
				" (more are waiting: raise --limit)\n"), out)
		})
	}
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

// replayJSON runs dlq replay --json with args and decodes its report, whatever the exit status.
func (l *letters) replayJSON(args ...string) (replayReport, error) {
	l.t.Helper()
	out, err := l.run(append([]string{"dlq", "replay", "--json"}, args...)...)
	var rep replayReport
	require.NoError(l.t, json.Unmarshal([]byte(out), &rep), out)
	return rep, err
}

func TestDLQ_ReplayByReasonKeepsTheDeadLettersWithoutPayload(t *testing.T) {
	t.Parallel()
	for _, sc := range dlqBrokers() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			l := setupLetters(t, sc)
			l.deadLetter("a", "ledger", "permanent: account 7 is closed", `{"n":1}`)
			l.deadLetter("b", "ledger", "permanent: payload is not JSON", "nope")
			l.deadLetter("c", "billing", "permanent: account 7 is closed", `{"n":3}`)
			// The dead-letter broker refuses d's payload: its dead letter carries none, under a
			// derived id.
			require.NoError(t, middleware.PublishDeadLetter(context.Background(), payloadRefuser{l.b.Publisher()}, l.dlq, "ledger",
				&messagedata.MessageData{ID: "d", Topic: l.topic, Payload: []byte(`{"n":4}`), Headers: map[string]string{}},
				errors.New("permanent: account 7 is closed")))
			l.waitFor(4)
			list := l.listJSON()
			require.Equal(t, "d", list.DeadLetters[3].OriginalID)
			require.Contains(t, list.DeadLetters[3].PayloadDropped, "7 bytes and 0 headers dropped")
			dID := list.DeadLetters[3].ID
			table, err := l.run("dlq", "list")
			require.NoError(t, err)
			require.Regexp(t, `(?m)^`+dID+`\s+\S+\s+`+l.topic+`\s+ledger\s+-\s+1\s+dropped\s+permanent: account 7 is closed$`, table)

			// A part of the reason chooses a and c, and d, which fails for want of a payload and
			// stays; replay goes on past it.
			rep, err := l.replayJSON("--reason", "account 7")
			require.ErrorContains(t, err, `1 of 3 chosen dead letters not replayed; the first, "`+dID+`": the dead letter carries no payload: 7 bytes and 0 headers dropped`)
			require.Equal(t, []string{"a", "c"}, []string{rep.Replayed[0].ID, rep.Replayed[1].ID})
			require.Len(t, rep.Replayed, 2)
			require.Len(t, rep.Failed, 1)
			require.Equal(t, failed{ID: dID, Topic: l.topic, Handler: "ledger", Reason: "permanent: account 7 is closed",
				Error: "the dead letter carries no payload: " + list.DeadLetters[3].PayloadDropped}, rep.Failed[0])
			require.Equal(t, []kept{{ID: "b", Topic: l.topic, Handler: "ledger", Reason: "permanent: payload is not JSON"}}, rep.Kept)
			require.Empty(t, rep.NotFound)
			l.requireWaiting(l.dlq, []string{"b", dID})
			l.requireWaiting(l.topic, []string{"a", "c"}, "replayed with their payloads")

			// The original id chooses d too; the text report says why it stays.
			out, err := l.run("dlq", "replay", "--id", "d")
			require.Error(t, err)
			require.Contains(t, out, "not replayed: "+dID+": the dead letter carries no payload: 7 bytes and 0 headers dropped: ")
			require.Contains(t, out, "replayed 0 dead letters, failed 1, kept 1 in ")

			// A reason that matches nothing says so, and replays nothing; so does an exact one.
			_, err = l.replayJSON("--reason", "Account 7")
			require.ErrorContains(t, err, `no dead letter whose reason contains "Account 7" in `+l.dlq+` for consumer group billing`)
			rep, err = l.replayJSON("--reason", "permanent: payload is not JSON")
			require.NoError(t, err)
			require.Equal(t, "b", rep.Replayed[0].ID)
			l.requireWaiting(l.dlq, []string{dID})
		})
	}
}

// answer is a standard input that runs before, the first time it is read, and then reads as
// text.
type answer struct {
	before func()
	text   io.Reader
}

func (a *answer) Read(p []byte) (int, error) {
	if a.before != nil {
		a.before()
		a.before = nil
	}
	return a.text.Read(p)
}

func TestDLQ_DeleteRemovesExactlyTheChosenDeadLetters(t *testing.T) {
	t.Parallel()
	for _, sc := range dlqBrokers() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			l := setupLetters(t, sc)
			l.deadLetter("a", "ledger", "permanent: account 7 is closed", `{"n":1}`)
			l.deadLetter("b", "ledger", "permanent: payload is not JSON", "nope")
			l.deadLetter("c", "billing", "permanent: account 7 is closed", `{"n":3}`)
			l.deadLetter("d", "ledger", "permanent: test message, ignore", `{}`)
			l.deadLetter("e", "ledger", "permanent: test message, ignore", `{}`)
			l.waitFor(5)
			all := []string{"a", "b", "c", "d", "e"}
			deleteArgs := func(args ...string) []string {
				return append(append([]string{"dlq", "delete"}, args...), "--broker", l.url, "--topic", l.dlq)
			}

			// Without --yes it shows what it would delete and asks; no, or no answer at all,
			// deletes nothing.
			for _, in := range []string{"n\n", "", "maybe\n"} {
				out, err := runWithInput(t, strings.NewReader(in), deleteArgs("--id", "b")...)
				require.ErrorIs(t, err, errNotConfirmed, "answer %q", in)
				require.Regexp(t, `(?m)^  b  `+l.topic+`  handler ledger: permanent: payload is not JSON$`, out)
				require.Contains(t, out, "Delete 1 dead letter in "+l.dlq+" for consumer group billing on "+l.b.String()+" for good? [y/N] ")
				require.NotContains(t, out, "deleted")
				l.requireWaiting(l.dlq, all)
			}

			// Yes deletes it, and only it, and says so. (The answer is not echoed here: the
			// report follows the question on its line.)
			out, err := runWithInput(t, strings.NewReader("y\n"), deleteArgs("--id", "b")...)
			require.NoError(t, err)
			require.Regexp(t, `(?m)(^|\[y/N\] )deleted  b  `+l.topic+`  handler ledger: permanent: payload is not JSON$`, out)
			require.Contains(t, out, "\ndeleted 1 dead letter, kept 4 in "+l.dlq+" for consumer group billing on "+l.b.String()+"\n")
			l.requireWaiting(l.dlq, []string{"a", "c", "d", "e"})

			// By reason, without asking.
			out, err = run(t, deleteArgs("--reason", "test message", "--yes", "--json")...)
			require.NoError(t, err)
			var rep deleteReport
			require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
			require.Equal(t, []deleted{
				{ID: "d", Topic: l.topic, Handler: "ledger", Reason: "permanent: test message, ignore"},
				{ID: "e", Topic: l.topic, Handler: "ledger", Reason: "permanent: test message, ignore"},
			}, rep.Deleted)
			require.Equal(t, []string{"a", "c"}, []string{rep.Kept[0].ID, rep.Kept[1].ID})
			require.Len(t, rep.Kept, 2)
			l.requireWaiting(l.dlq, []string{"a", "c"})

			// A dead letter that arrives while the operator reads the question is not deleted,
			// though it matches: only those shown are.
			in := &answer{text: strings.NewReader("yes\n"), before: func() {
				l.deadLetter("f", "ledger", "permanent: account 7 is closed", `{"n":6}`)
				l.waitFor(3)
			}}
			out, err = runWithInput(t, in, deleteArgs("--reason", "account 7 is closed")...)
			require.NoError(t, err)
			require.Contains(t, out, "Delete 2 dead letters in ")
			require.Contains(t, out, "\ndeleted 2 dead letters, kept 1 in ")
			l.requireWaiting(l.dlq, []string{"f"})

			// Ids or a reason that match nothing delete nothing, and say so.
			out, err = run(t, deleteArgs("--id", "nope", "--id", "f", "--yes")...)
			require.ErrorContains(t, err, `no dead letter with id "nope" in `+l.dlq+` for consumer group billing`)
			require.Contains(t, out, "deleted 1 dead letter, kept 0 in ")
			require.Contains(t, out, "not found: nope\n")
			_, err = run(t, deleteArgs("--reason", "never", "--yes")...)
			require.ErrorContains(t, err, `no dead letter whose reason contains "never"`)

			// --all on an empty topic is not an error.
			out, err = run(t, deleteArgs("--all", "--yes")...)
			require.NoError(t, err)
			require.Equal(t, "deleted 0 dead letters, kept 0 in "+l.dlq+" for consumer group billing on "+l.b.String()+"\n", out)
		})
	}
}

func TestDLQ_DeleteAllAfterConfirmationEmptiesTheTopic(t *testing.T) {
	t.Parallel()
	l := setupLetters(t, dlqBrokers()[3]) // sqlite
	require.Equal(t, "sqlite", l.sc.name)
	for _, id := range []string{"a", "b\x1b[2K", "c"} {
		l.deadLetter(id, "ledger", "permanent: bad", "{}")
	}
	out, err := runWithInput(t, strings.NewReader("Y\n"), "dlq", "delete", "--all", "--broker", l.url, "--topic", l.dlq)
	require.NoError(t, err)
	requireTerminalSafe(t, out)
	require.Contains(t, out, "  b\\x1b[2K  ")
	require.Contains(t, out, "Delete 3 dead letters in ")
	require.Contains(t, out, "\ndeleted 3 dead letters, kept 0 in ")
	require.Empty(t, l.waiting(l.dlq))
	out, err = run(t, "dlq", "list", "--broker", l.url, "--topic", l.dlq)
	require.NoError(t, err)
	require.Equal(t, "no dead letters in "+l.dlq+" for consumer group billing on "+l.b.String()+"\n", out)
}

// listJSON runs dlq list --json and decodes its report.
func (l *letters) listJSON() listReport {
	l.t.Helper()
	out, err := l.run("dlq", "list", "--json")
	require.NoError(l.t, err, out)
	var rep listReport
	require.NoError(l.t, json.Unmarshal([]byte(out), &rep), out)
	return rep
}

// rawCarriers are the brokers that carry any id and header value as it is: the others replace
// the id (PostgreSQL and MySQL store it as UTF-8 text) or the headers (NATS refuses line
// breaks in them) with header-safe ones, which the dead letter keeps.
var rawCarriers = map[string]bool{"sqlite": true, "redis": true, "amqp": true}

func TestDLQ_TextOutputEscapesWhatTheMessagesCarry(t *testing.T) {
	t.Parallel()
	for _, sc := range dlqBrokers() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			l := setupLetters(t, sc)
			const (
				erase   = "bad\x1b[2K-1"   // ESC [ 2 K erases the terminal's line
				invalid = "bad\xff\xfe-2"  // 0xff is text/tabwriter's escape character
				handler = "ledger\x1b[31m" // colours the rest of the screen red
				reason  = "no\tsuch\naccount\r\x1b]0;pwned\x07 \u202edrowssap"
				payload = "\x1b[2J\x1b[Hcleared"
			)
			l.deadLetter(erase, handler, reason, payload)
			l.waitFor(1)
			l.deadLetter(invalid, handler, reason, "{}")
			l.waitFor(2)
			msgs, err := l.b.Peek(context.Background(), l.dlq, 10)
			require.NoError(t, err)
			require.Len(t, msgs, 2)
			if rawCarriers[sc.name] {
				require.Equal(t, []string{erase, invalid}, []string{msgs[0].UUID, msgs[1].UUID})
				require.Equal(t, reason, msgs[0].Metadata.Get(messagedata.HeaderDeadLetterReason))
			}

			out, err := l.run("dlq", "list", "--payload")
			require.NoError(t, err)
			requireTerminalSafe(t, out)
			// The summary, a blank line, then the dead letters.
			lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
			blank := slices.Index(lines, "")
			require.Positive(t, blank, out)
			for _, g := range lines[1:blank] {
				require.Regexp(t, `^[12]\s+ledger\S*\s+no\S*such`, g)
			}
			lines = lines[blank+1:]
			require.Len(t, lines, 4, out)
			for i, m := range msgs {
				md := m.Metadata
				require.Regexp(t, `^`+regexp.QuoteMeta(printable(m.UUID))+`\s+\S+\s+`+l.topic+`\s+`+
					regexp.QuoteMeta(printable(md.Get(messagedata.HeaderDeadLetterHandler)))+`\s+-\s+1\s+\d+\s+`+
					regexp.QuoteMeta(printable(md.Get(messagedata.HeaderDeadLetterReason)))+`\s+"`, lines[1+i])
				// The columns line up: the time starts under its header.
				require.Equal(t, strings.Index(lines[0], "DEAD-LETTERED"), strings.Index(lines[1+i], " 20")+1, "%q under %q", lines[1+i], lines[0])
			}
			if rawCarriers[sc.name] {
				require.True(t, strings.HasPrefix(lines[1], `bad\x1b[2K-1  `), lines[1])
				require.True(t, strings.HasPrefix(lines[2], `bad\xff\xfe-2  `), lines[2])
				require.Contains(t, lines[1], `  ledger\x1b[31m  `)
				require.Contains(t, lines[1], `  no\tsuch\naccount\r\x1b]0;pwned\a \u202edrowssap  `)
				require.True(t, strings.HasSuffix(lines[1], `  "\x1b[2J\x1b[Hcleared"`), lines[1])
			}

			// replay and its report: the ids as the broker carries them, given back as they are.
			out, err = l.run("dlq", "replay", "--id", msgs[0].UUID, "--id", msgs[1].UUID, "--id", "nope\x1b[2K")
			require.ErrorContains(t, err, `"nope\x1b[2K"`)
			requireTerminalSafe(t, out)
			for _, m := range msgs {
				require.Regexp(t, `(?m)^replayed\s+`+regexp.QuoteMeta(printable(m.UUID))+`\s+-> `+l.topic+`\s+handler `+
					regexp.QuoteMeta(printable(m.Metadata.Get(messagedata.HeaderDeadLetterHandler)))+`, delivery -, attempt 1: `, out)
			}
			require.Contains(t, out, "not found: nope\\x1b[2K\n")
			require.Contains(t, out, "\nreplayed 2 dead letters, kept 0 in "+l.dlq)
			require.Empty(t, l.waiting(l.dlq))
		})
	}
}

// waitFor waits until n dead letters wait in the fixture's dead-letter topic.
func (l *letters) waitFor(n int) {
	l.t.Helper()
	testsvc.Eventually(l.t, 30*time.Second, func() bool { return len(l.waiting(l.dlq)) == n },
		"%d dead letters never waited in %s", n, l.dlq)
}

func TestDLQ_ReplayAllGoesOnPastADeadLetterTheBrokerCannotTakeBack(t *testing.T) {
	t.Parallel()
	l := setupLetters(t, dlqBrokers()[0])
	require.Equal(t, "amqp", l.sc.name)
	// A foreign producer's 256-byte id: RabbitMQ's message_id property holds 255 bytes, so its
	// dead letter went out under a derived id, and its replay, under its own, cannot go out.
	long := strings.Repeat("x", 256)
	var want []string
	for i := range 10 {
		id := fmt.Sprintf("m-%02d", i)
		if i == 4 {
			id = long
		} else {
			want = append(want, id)
		}
		l.deadLetter(id, "ledger", "permanent: account 7 is closed", `{}`)
	}
	l.waitFor(10)

	out, err := l.run("dlq", "replay", "--all", "--json")
	require.Error(t, err)
	require.Equal(t, exitFailure, exitCode(err))
	require.ErrorContains(t, err, "1 of 10 chosen dead letters not replayed")
	var rep replayReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	var replayedIDs []string
	for _, r := range rep.Replayed {
		replayedIDs = append(replayedIDs, r.ID)
	}
	require.Equal(t, want, replayedIDs)
	require.Len(t, rep.Failed, 1)
	require.Contains(t, rep.Failed[0].Error, "is 256 bytes, the AMQP message_id property allows 255")
	require.Empty(t, rep.Kept)
	l.requireWaiting(l.topic, want, "the nine are back on their topic")
	stays := l.waiting(l.dlq)
	require.Equal(t, []string{rep.Failed[0].ID}, stays, "the one that failed waits")

	// Run after run, the others are not held up by it: it alone is reported again.
	out, err = l.run("dlq", "replay", "--all")
	require.Error(t, err)
	require.Contains(t, out, "replayed 0 dead letters, failed 1, kept 0 in ")
	require.Contains(t, out, "not replayed: "+stays[0]+": ")
}

func TestDLQ_ATopicOrGroupThatDoesNotExistIsAnErrorThatSaysSo(t *testing.T) {
	t.Parallel()
	l := setupLetters(t, dlqBrokers()[3]) // sqlite
	q, err := deadletter.New(l.b, deadletter.Config{Topic: "typo"})
	require.NoError(t, err)
	// What a broker's view returns for a dead-letter queue that does not exist.
	missing := fmt.Errorf("broker: peek topic %q for consumer group %q: %w: queue typo.billing", "typo", "billing", broker.ErrNotFound)
	err = notFound(missing, q)
	require.ErrorIs(t, err, broker.ErrNotFound)
	require.ErrorContains(t, err, `no dead-letter topic "typo" for consumer group "billing" on `+l.b.String()+` (check --topic, and --group`)
	require.Equal(t, exitFailure, exitCode(err))
	require.Equal(t, errors.New("other"), notFound(errors.New("other"), q), "other errors pass as they are")
}
